// A read-only memory-mapped file with bounds-checked access, for checkpoint readers that must
// never read past the end of untrusted input (safetensors, GGUF). Errors name the file.
//
//   models::MappedFile f("model.safetensors");
//   const std::uint8_t* p = f.bytes(offset, length, "tensor model.norm.weight");  // or throws
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace rondo::models {

// The most read_text_file reads by default: far above any config.json, tokenizer_config.json,
// chat template or sharded-checkpoint index, far below the memory of the machines Rondo runs on.
inline constexpr std::uint64_t kTextFileLimit = 64ull << 20;
// tokenizer.json: the largest known are some 35 MB (Gemma 3's); parsing costs several times that.
inline constexpr std::uint64_t kTokenizerFileLimit = 256ull << 20;

// The whole of a (small) text file: config.json, tokenizer.json. Throws Error naming the path and
// `what` it was wanted for when it cannot be read, is not a file or a pipe (a folder, a device such
// as /dev/zero) or is longer than `limit` bytes (read no further than that).
std::string read_text_file(const std::string& path, const std::string& what,
                           std::uint64_t limit = kTextFileLimit);

// Writes `text` to `path` so that a crash leaves the old file or the new one, never a part:
// "<path>.tmp" written and fsynced, renamed over `path`, the folder fsynced. Throws Error naming
// the path and the failed call.
void write_file_durably(const std::string& path, const std::string& text);

// A file written the same way, piece by piece (large files produced while they are written): the
// bytes go to "<path><tmp_suffix>" (default ".tmp.<pid>", which a later run's sweep recognises as
// left by a stopped process), and commit() fsyncs it, renames it over `path` and fsyncs the folder.
// Destroyed without commit (an exception on the way), the temporary is removed. Errors name the
// file and the failed call.
//
//   DurableFile f(path);
//   f.write(header.data(), header.size());
//   f.commit();
class DurableFile {
 public:
  explicit DurableFile(std::string path, std::string tmp_suffix = {});
  ~DurableFile();
  DurableFile(const DurableFile&) = delete;
  DurableFile& operator=(const DurableFile&) = delete;

  void write(const void* data, std::size_t bytes);
  void commit();
  const std::string& temporary() const { return tmp_; }

 private:
  std::string path_;
  std::string tmp_;
  int fd_ = -1;
};

// Drops the pages of a read-only file mapping inside [data, data + bytes) from this process
// (madvise MADV_DONTNEED on the whole pages inside the range): they stop counting in its resident
// set, and are read from the file again if touched. Loading calls it after copying a tensor out,
// so that reading a checkpoint larger than the host memory budget does not fill the process with
// file pages. Best effort: never throws.
void release_mapped_pages(const void* data, std::size_t bytes) noexcept;

class MappedFile {
 public:
  // Throws Error naming the path if it cannot be opened or mapped. An empty file maps to size 0.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&&) = delete;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  std::uint64_t size() const { return size_; }
  const std::uint8_t* data() const { return data_; }

  // [offset, offset + length) if it lies inside the file, else throws Error naming the file,
  // `what` and the range. Overflow-safe.
  const std::uint8_t* bytes(std::uint64_t offset, std::uint64_t length,
                            const std::string& what) const;
  bool contains(std::uint64_t offset, std::uint64_t length) const {
    return offset <= size_ && length <= size_ - offset;
  }

 private:
  std::string path_;
  const std::uint8_t* data_ = nullptr;
  std::uint64_t size_ = 0;
};

}  // namespace rondo::models
