// Remembered drive speeds (disk_speeds.h): one small JSON file, rewritten whole.
#include "engine/disk_speeds.h"

#include <sys/stat.h>
#include <unistd.h>

#include <ctime>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/speed.h"

namespace rondo::engine {

namespace fs = std::filesystem;

namespace {

fs::path cache_file() {
  const std::string dir = speed_cache_dir();
  return dir.empty() ? fs::path() : fs::path(dir) / "disk-speeds.json";
}

// The filesystem of `dir` or of its nearest existing parent.
std::optional<unsigned long long> filesystem_of(const std::string& dir) {
  std::error_code ec;
  fs::path p = fs::absolute(dir, ec);
  if (ec) return std::nullopt;
  for (;; p = p.parent_path()) {
    struct stat st {};
    if (::stat(p.c_str(), &st) == 0) return static_cast<unsigned long long>(st.st_dev);
    if (p == p.parent_path()) return std::nullopt;
  }
}

nlohmann::json read_entries() {
  std::ifstream in(cache_file());
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  return j.is_object() && j.contains("drives") && j["drives"].is_array() ? j["drives"]
                                                                        : nlohmann::json::array();
}

}  // namespace

bool remember_disk_speed(const std::string& dir, double read_bytes_per_s,
                         double write_bytes_per_s) {
  const fs::path file = cache_file();
  const std::optional<unsigned long long> dev = filesystem_of(dir);
  if (file.empty() || !dev) return false;
  nlohmann::json kept = nlohmann::json::array();
  for (const auto& e : read_entries())
    if (e.is_object() && e.value("st_dev", 0ull) != *dev) kept.push_back(e);
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  ::localtime_r(&now, &local);
  char when[32];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M", &local);
  std::error_code ec;
  kept.push_back({{"st_dev", *dev},
                  {"dir", fs::absolute(dir, ec).lexically_normal().string()},
                  {"read_bytes_per_s", read_bytes_per_s},
                  {"write_bytes_per_s", write_bytes_per_s},
                  {"measured_at", when}});
  // Written whole under a temporary name, then renamed: a concurrent reader sees one file or the
  // other.
  fs::create_directories(file.parent_path(), ec);
  const fs::path tmp = file.string() + fmt::format(".{}.tmp", static_cast<long>(::getpid()));
  {
    std::ofstream out(tmp);
    out << nlohmann::json{{"drives", kept}}.dump(2) << "\n";
    if (!out) {
      fs::remove(tmp, ec);
      return false;
    }
  }
  fs::rename(tmp, file, ec);
  if (ec) fs::remove(tmp, ec);
  return !ec;
}

std::optional<RememberedDiskSpeed> remembered_disk_speed(const std::string& dir) {
  const std::optional<unsigned long long> dev = filesystem_of(dir);
  if (!dev || cache_file().empty()) return std::nullopt;
  for (const auto& e : read_entries())
    if (e.is_object() && e.value("st_dev", 0ull) == *dev && e.value("read_bytes_per_s", 0.0) > 0)
      return RememberedDiskSpeed{.dir = e.value("dir", ""),
                                 .read_bytes_per_s = e.value("read_bytes_per_s", 0.0),
                                 .write_bytes_per_s = e.value("write_bytes_per_s", 0.0),
                                 .measured_at = e.value("measured_at", "")};
  return std::nullopt;
}

}  // namespace rondo::engine
