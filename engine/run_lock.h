// One writer per run folder. `rondo train`, `rondo train --resume` and `rondo export` hold an
// exclusive flock on <run>/rondo.lock while they work; the kernel releases it when the process
// ends, however it ends (SIGKILL included), so a lock is never stale. The holder writes its PID and
// what it does into the file, so that a second process is refused with both.
//
//   engine::RunLock lock(run_dir, "rondo train");  // throws Error naming the holder
//   for (const std::string& f : lock.remove_stale_temporaries()) log("removed " + f);
#pragma once

#include <string>
#include <vector>

namespace rondo::engine {

class RunLock {
 public:
  static constexpr const char* kFile = "rondo.lock";

  // The folder must exist. Throws Error when another process holds the lock ("<dir> is in use by
  // process N (rondo train --resume) ..."), or naming the failed call. `reader` (an export): a
  // folder this process may not write (read-only mount, another user's run) is locked through its
  // existing lock file opened for reading, or not at all when it has none (no Rondo process could
  // write there either); read_only() then says so.
  RunLock(const std::string& run_dir, const std::string& what, bool reader = false);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

  // What a process killed while writing left behind, now that no other process writes here:
  // Only names Rondo writes: config.toml.tmp in the run folder, and in its export folders
  // (adapter/, merged/, export-*/) "<file>.tmp.<pid>" files of processes that are gone and
  // "<file>.tmp" files (atomic writes that never reached their rename). Nothing else in the folder
  // is touched (a run folder could be any folder). Returns the paths removed.
  std::vector<std::string> remove_stale_temporaries() const;

  // Who holds the folder's lock now ("process N (rondo train)"), or "" when nobody does. Takes
  // and drops a shared lock at once: a writer starting in that instant is refused as usual.
  static std::string holder(const std::string& run_dir);

  // Whether the folder could not be written (only with `reader`).
  bool read_only() const { return read_only_; }

  // What in `run_dir` Rondo did not make: every entry but its own names (rondo.lock, config.toml
  // and config.toml.tmp, events.jsonl, checkpoints/, ranks/ (a data-parallel run's other ranks),
  // the export folders adapter/, merged/, gguf/, gguf-adapter/ and export-*/), sorted; empty for a
  // missing folder. A new run never goes into a folder holding any, and only a folder with Rondo's
  // lock file and nothing else is a run that never started (a model folder, $HOME or an empty
  // folder is not a run).
  static std::vector<std::string> foreign_entries(const std::string& run_dir);
  // "a, b, c and 4 more": the first entries of such a list, for a message.
  static std::string list_some(const std::vector<std::string>& names);

 private:
  std::string dir_;
  int fd_ = -1;
  bool read_only_ = false;
};

}  // namespace rondo::engine
