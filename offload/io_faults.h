// Fault injection for the offload I/O path: rules such as "the 3rd write fails with ENOSPC" that
// the I/O backends apply where the OS answers (an open, a fallocate, each read or write attempt),
// so the code above them — retry loops, checksums, error messages — meets failures exactly as a
// real drive would produce them. The rules are passed in (NvmeStoreOptions::faults, the disk
// probes' `faults`): this library reads no environment variable. The tests build them, and so does
// `rondo` from RONDO_FAULT_IO for the CLI fault tests (cli/test_faults.cpp).
//
//   RONDO_FAULT_IO=enospc:write:3,corrupt:read:2 rondo train run.toml
//   auto rules = offload::parse_fault_rules("eio:read:1+", "test");  // every read fails
//
// Syntax (docs/offload.md): rules separated by commas, each `kind[:op[:nth]]`.
//   kind  an errno name — eio, enospc, edquot, enomem, eagain, eintr, eperm, enosys, einval,
//         eopnotsupp, eacces — or one of:
//           short           a read returns fewer bytes than asked, and so does every later read
//                           past that point (the file looks truncated); op read
//           partial         one read or write transfers only half (a transient short transfer
//                           that the backend must resubmit); op read or write
//           corrupt         a read succeeds but one byte of the data is flipped; op read
//           einval_odirect  an open with O_DIRECT fails with EINVAL (a filesystem that refuses
//                           it); op open, every such open unless nth is given
//   op    read | write | open | fallocate | register (io_uring buffer registration) |
//         setup (io_uring_queue_init). Optional where the kind has one op only (short,
//         corrupt, einval_odirect).
//   nth   which attempt of that op, counted from 1 per store (a resubmitted remainder counts as a
//         new attempt): `3` = the 3rd only, `3+` = the 3rd and every later one, `*` = every one.
//         Default 1 (for einval_odirect: `*`).
// The first rule that matches an attempt applies.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace rondo::offload {

enum class IoOp : std::uint8_t { kRead, kWrite };

enum class FaultOp : std::uint8_t { kRead, kWrite, kOpen, kFallocate, kRegister, kSetup };
inline constexpr int kFaultOpCount = 6;
const char* to_string(FaultOp op);  // "read", "write", ...

enum class FaultKind : std::uint8_t {
  kErrno,          // the attempt fails with `error`
  kShort,          // persistent short read (truncated file)
  kPartial,        // one transient short transfer
  kCorrupt,        // one flipped byte in the data read
  kEinvalODirect,  // O_DIRECT refused at open
};

struct FaultRule {
  FaultKind kind = FaultKind::kErrno;
  int error = 0;  // kErrno: the errno value (EIO, ENOSPC, ...)
  FaultOp op = FaultOp::kRead;
  std::uint64_t nth = 1;   // 1-based attempt of `op`; 0 = every attempt
  bool and_later = false;  // nth and every later attempt
  std::string text;        // the rule as written, for messages
};

// Throws rondo::Error naming `source` (where the text came from: an environment variable, an
// option), the bad rule and the syntax on any problem. An empty text gives no rules.
std::vector<FaultRule> parse_fault_rules(const std::string& text, const std::string& source);

// Applies rules to one store's attempts. Thread-safe: backends call it from several threads.
class FaultInjector {
 public:
  explicit FaultInjector(std::vector<FaultRule> rules);

  bool empty() const { return rules_.empty(); }
  const std::vector<FaultRule>& rules() const { return rules_; }

  // For open, fallocate, register and setup: the errno this attempt must fail with, 0 = none.
  // `direct`: the open asks for O_DIRECT.
  int on_call(FaultOp op, bool direct = false);

  // For a read or write attempt on `fd` at file `offset` over `iov` that returned `result`
  // (bytes, or -errno): the result the backend must act on. May flip a byte of the data read
  // (corrupt) or shorten the result (short, partial); never lengthens it. A shortened transfer is
  // made real, so that only resubmitting the rest repairs it: the bytes not "read" are
  // overwritten in the buffer, the bytes not "written" are overwritten in the file.
  std::int64_t on_transfer(IoOp op, int fd, std::uint64_t offset, const iovec* iov, int iov_count,
                           std::int64_t result);

  // Attempts seen so far of `op` (for tests).
  std::uint64_t attempts(FaultOp op) const;

 private:
  const FaultRule* match(FaultOp op, std::uint64_t attempt, bool direct) const;

  std::vector<FaultRule> rules_;
  std::atomic<std::uint64_t> counts_[kFaultOpCount] = {};
  // kShort: reads at or past this file offset return nothing (the "end" of the truncated file).
  std::atomic<std::uint64_t> truncated_at_{UINT64_MAX};
};

}  // namespace rondo::offload
