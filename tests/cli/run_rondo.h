// Runs the real `rondo` binary (RONDO_BIN) for the CLI tests and returns what a user would read.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace rondo::test {

struct Result {
  int code;
  std::string out;  // stdout, and stderr unless left out
};

// `rondo <args>`; `env` (e.g. "A=1 B=2") goes before the command.
inline Result run_rondo(const std::string& args, bool with_stderr = true,
                        const std::string& env = "") {
  const std::string cmd =
      env + " " + RONDO_BIN + " " + args + (with_stderr ? " 2>&1" : " 2>/dev/null");
  Result r{-1, {}};
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return r;
  std::array<char, 4096> buf;
  std::size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0)
    r.out.append(buf.data(), n);
  const int status = pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

inline bool contains(const std::string& s, const std::string& what) {
  return s.find(what) != std::string::npos;
}

}  // namespace rondo::test
