#include "offload/io_faults.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "kernels/error.h"

namespace rondo::offload {
namespace {

struct ErrnoName {
  const char* name;
  int value;
};
constexpr ErrnoName kErrnos[] = {
    {"eio", EIO},       {"enospc", ENOSPC},         {"edquot", EDQUOT}, {"enomem", ENOMEM},
    {"eagain", EAGAIN}, {"eintr", EINTR},           {"eperm", EPERM},   {"enosys", ENOSYS},
    {"einval", EINVAL}, {"eopnotsupp", EOPNOTSUPP}, {"eacces", EACCES},
};
constexpr const char* kOpNames[kFaultOpCount] = {"read",      "write",    "open",
                                                 "fallocate", "register", "setup"};

std::string trim(const std::string& s) {
  std::size_t a = s.find_first_not_of(" \t"), b = s.find_last_not_of(" \t");
  return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::size_t start = 0;
  for (;;) {
    std::size_t at = s.find(sep, start);
    parts.push_back(s.substr(start, at == std::string::npos ? std::string::npos : at - start));
    if (at == std::string::npos) return parts;
    start = at + 1;
  }
}

}  // namespace

const char* to_string(FaultOp op) {
  return kOpNames[static_cast<int>(op)];
}

std::vector<FaultRule> parse_fault_rules(const std::string& text, const std::string& source) {
  std::vector<FaultRule> rules;
  for (const std::string& raw : split(text, ',')) {
    const std::string item = trim(raw);
    if (item.empty()) continue;
    auto fail = [&](const std::string& why) {
      throw Error(source + ": bad fault rule '" + item + "': " + why +
                  "; expected rules kind[:op[:nth]] separated by commas, e.g. "
                  "enospc:write:3,corrupt:read:2 (kinds: eio, enospc, edquot, enomem, eagain, "
                  "eintr, eperm, enosys, einval, eopnotsupp, eacces, short, partial, corrupt, "
                  "einval_odirect; ops: read, write, open, fallocate, register, setup; nth: N, "
                  "N+ or *; see docs/offload.md)");
    };
    std::vector<std::string> parts = split(item, ':');
    if (parts.size() > 3) fail("too many ':'");
    for (std::string& p : parts)
      p = trim(p);
    FaultRule rule;
    rule.text = item;
    const std::string& kind = parts[0];
    bool op_fixed = false;  // the kind has one op only, so it may be left out
    if (kind == "short") {
      rule.kind = FaultKind::kShort;
      rule.op = FaultOp::kRead;
      op_fixed = true;
    } else if (kind == "corrupt") {
      rule.kind = FaultKind::kCorrupt;
      rule.op = FaultOp::kRead;
      op_fixed = true;
    } else if (kind == "einval_odirect") {
      rule.kind = FaultKind::kEinvalODirect;
      rule.op = FaultOp::kOpen;
      rule.nth = 0;
      op_fixed = true;
    } else if (kind == "partial") {
      rule.kind = FaultKind::kPartial;
    } else {
      bool found = false;
      for (const ErrnoName& e : kErrnos)
        if (kind == e.name) {
          rule.error = e.value;
          found = true;
        }
      if (!found) fail("unknown kind '" + kind + "'");
    }
    if (parts.size() >= 2) {
      bool found = false;
      for (int o = 0; o < kFaultOpCount; ++o)
        if (parts[1] == kOpNames[o]) {
          if (op_fixed && static_cast<FaultOp>(o) != rule.op)
            fail("'" + kind + "' applies to " + kOpNames[static_cast<int>(rule.op)] + " only");
          rule.op = static_cast<FaultOp>(o);
          found = true;
        }
      if (!found) fail("unknown op '" + parts[1] + "'");
    } else if (!op_fixed) {
      fail("'" + kind + "' needs an op");
    }
    if (rule.kind == FaultKind::kPartial && rule.op != FaultOp::kRead && rule.op != FaultOp::kWrite)
      fail("'partial' applies to read or write only");
    if (parts.size() == 3) {
      std::string n = parts[2];
      if (n == "*") {
        rule.nth = 0;
      } else {
        if (!n.empty() && n.back() == '+') {
          rule.and_later = true;
          n.pop_back();
        }
        if (n.empty() || n.find_first_not_of("0123456789") != std::string::npos || n.size() > 9)
          fail("nth '" + parts[2] + "' is not a count (N, N+ or *)");
        rule.nth = std::stoull(n);
        if (rule.nth == 0) fail("nth counts from 1");
      }
    }
    rules.push_back(std::move(rule));
  }
  return rules;
}

FaultInjector::FaultInjector(std::vector<FaultRule> rules) : rules_(std::move(rules)) {}

std::uint64_t FaultInjector::attempts(FaultOp op) const {
  return counts_[static_cast<int>(op)].load();
}

const FaultRule* FaultInjector::match(FaultOp op, std::uint64_t attempt, bool direct) const {
  for (const FaultRule& r : rules_) {
    if (r.op != op) continue;
    if (r.kind == FaultKind::kEinvalODirect && !direct) continue;
    if (r.nth == 0 || attempt == r.nth || (r.and_later && attempt >= r.nth)) return &r;
  }
  return nullptr;
}

int FaultInjector::on_call(FaultOp op, bool direct) {
  const std::uint64_t attempt = ++counts_[static_cast<int>(op)];
  const FaultRule* r = match(op, attempt, direct);
  if (r == nullptr) return 0;
  if (r->kind == FaultKind::kErrno) return r->error;
  if (r->kind == FaultKind::kEinvalODirect) return EINVAL;
  return 0;
}

namespace {

constexpr unsigned char kJunk = 0xA5;

// Overwrites bytes [from, to) of the segments.
void scribble(const iovec* iov, int count, std::uint64_t from, std::uint64_t to) {
  std::uint64_t base = 0;
  for (int i = 0; i < count && base < to; ++i) {
    const std::uint64_t len = iov[i].iov_len;
    const std::uint64_t a = std::max(from, base), b = std::min(to, base + len);
    if (a < b) std::memset(static_cast<char*>(iov[i].iov_base) + (a - base), kJunk, b - a);
    base += len;
  }
}

// Overwrites the file's bytes [offset, offset + bytes) (page-aligned, as the O_DIRECT file wants).
// Returns 0 or the errno of the failed write.
int scribble_file(int fd, std::uint64_t offset, std::uint64_t bytes) {
  if (fd < 0 || bytes == 0) return 0;
  void* junk = std::aligned_alloc(4096, bytes);
  if (junk == nullptr) return ENOMEM;
  std::memset(junk, kJunk, bytes);
  int error = 0;
  for (std::uint64_t done = 0; done < bytes;) {
    const ssize_t n = ::pwrite(fd, static_cast<char*>(junk) + done, bytes - done,
                               static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      error = n < 0 ? errno : EIO;
      break;
    }
    done += static_cast<std::uint64_t>(n);
  }
  std::free(junk);
  return error;
}

}  // namespace

std::int64_t FaultInjector::on_transfer(IoOp op, int fd, std::uint64_t offset, const iovec* iov,
                                        int iov_count, std::int64_t result) {
  const FaultOp fop = op == IoOp::kRead ? FaultOp::kRead : FaultOp::kWrite;
  const std::uint64_t attempt = ++counts_[static_cast<int>(fop)];
  // An earlier `short` rule truncated the file: nothing can be read past that point.
  if (op == IoOp::kRead && result > 0) {
    const std::uint64_t end = truncated_at_.load();
    const std::int64_t had = result;
    if (offset >= end)
      result = 0;
    else if (offset + static_cast<std::uint64_t>(result) > end)
      result = static_cast<std::int64_t>(end - offset);
    scribble(iov, iov_count, static_cast<std::uint64_t>(result), static_cast<std::uint64_t>(had));
  }
  const FaultRule* r = match(fop, attempt, false);
  if (r == nullptr) return result;
  constexpr std::int64_t kPage = 4096;  // keeps resubmitted remainders O_DIRECT-aligned
  switch (r->kind) {
    case FaultKind::kErrno:
      return -r->error;
    case FaultKind::kShort: {
      if (result <= 0) return result;
      const std::int64_t keep = result / 2 / kPage * kPage;
      std::uint64_t end = offset + static_cast<std::uint64_t>(keep);
      std::uint64_t now = truncated_at_.load();
      while (end < now && !truncated_at_.compare_exchange_weak(now, end)) {
      }
      scribble(iov, iov_count, static_cast<std::uint64_t>(keep),
               static_cast<std::uint64_t>(result));
      return keep;
    }
    case FaultKind::kPartial: {
      if (result < 2 * kPage) return result;
      const std::int64_t keep = result / 2 / kPage * kPage;
      const auto from = static_cast<std::uint64_t>(keep), to = static_cast<std::uint64_t>(result);
      if (op == IoOp::kRead) {
        scribble(iov, iov_count, from, to);
      } else if (int e = scribble_file(fd, offset + from, to - from)) {
        return -e;
      }
      return keep;
    }
    case FaultKind::kCorrupt: {
      if (result <= 0) return result;
      std::uint64_t at = static_cast<std::uint64_t>(result) / 2;
      for (int i = 0; i < iov_count; ++i) {
        if (at < iov[i].iov_len) {
          static_cast<unsigned char*>(iov[i].iov_base)[at] ^= 0xFF;
          break;
        }
        at -= iov[i].iov_len;
      }
      return result;
    }
    case FaultKind::kEinvalODirect:
      return result;
  }
  return result;
}

}  // namespace rondo::offload
