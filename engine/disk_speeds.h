// What `rondo devices --disk DIR` measured, remembered per drive so that planning uses it: a run
// with hardware.offload_dir on a drive measured before plans with that drive's read speed instead
// of the 3 GB/s assumed otherwise (hardware.disk_speed, when set, still wins). Kept in
// speed_cache_dir()/disk-speeds.json beside the CPU speeds (engine/speed.h), one entry per
// filesystem (its st_dev), the newest measurement winning. Used by the CLI (writing) and
// engine/estimate.cpp (reading); an unreadable or unwritable cache is as good as none.
//
//   engine::remember_disk_speed("/mnt/nvme/rondo", d.read_bytes_per_s, d.write_bytes_per_s);
//   if (auto r = engine::remembered_disk_speed("/mnt/nvme/rondo/run-3")) use(r->read_bytes_per_s);
#pragma once

#include <optional>
#include <string>

namespace rondo::engine {

struct RememberedDiskSpeed {
  std::string dir;  // the folder that was measured (absolute)
  double read_bytes_per_s = 0, write_bytes_per_s = 0;
  std::string measured_at;  // local time, "2026-12-06 03:55"
};

// Remembers a measurement of the drive holding `dir` (replacing an earlier one of the same
// filesystem). False when the cache cannot be written (nothing else happens).
bool remember_disk_speed(const std::string& dir, double read_bytes_per_s,
                         double write_bytes_per_s);

// The measurement remembered for the filesystem holding `dir` (or its nearest existing parent);
// nullopt when there is none.
std::optional<RememberedDiskSpeed> remembered_disk_speed(const std::string& dir);

}  // namespace rondo::engine
