// The GGUF reader on arbitrary bytes: metadata, tensor infos and each tensor's bytes inside the
// file, or rondo::Error.
#include <cstdint>

#include "fuzz_file.h"
#include "kernels/error.h"
#include "models/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = rondo::fuzz::write_input(data, size, ".gguf");
  try {
    const rondo::models::GgufFile f(path);
    std::uint64_t sum = f.version() + f.alignment();
    for (const auto& [key, value] : f.metadata()) {
      sum += key.size();
      // The typed accessors on whatever the key holds: a value or an Error.
      try {
        sum += f.get_string(key).size();
      } catch (const rondo::Error&) {
      }
      try {
        sum += static_cast<std::uint64_t>(f.get_int(key));
      } catch (const rondo::Error&) {
      }
      try {
        sum += f.get_strings(key).size();
      } catch (const rondo::Error&) {
      }
    }
    for (const rondo::models::GgufTensorInfo& t : f.tensors()) {
      sum += t.shape().size();
      const std::uint8_t* p = f.tensor_data(t);
      if (t.n_bytes != 0) sum += p[0] + p[t.n_bytes - 1];
    }
    (void)sum;
  } catch (const rondo::Error&) {
  }
  return 0;
}
