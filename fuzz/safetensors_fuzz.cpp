// The safetensors reader on arbitrary bytes: a parse either succeeds with every tensor inside the
// file, or throws rondo::Error. Anything else (a crash, a sanitizer report, another exception) is a
// bug.
#include <cstdint>
#include <cstring>

#include "fuzz_file.h"
#include "kernels/error.h"
#include "models/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = rondo::fuzz::write_input(data, size, ".safetensors");
  try {
    const rondo::models::SafetensorsFile f(path);
    std::uint64_t sum = 0;
    for (const rondo::models::TensorEntry& t : f.tensors()) {
      // Every byte a tensor claims must be readable.
      for (std::uint64_t i = 0; i < t.bytes; i += 4096)
        sum += t.data[i];
      if (t.bytes != 0) sum += t.data[t.bytes - 1];
      if (f.find(t.name) != &t) __builtin_trap();
    }
    for (const auto& [k, v] : f.metadata())
      sum += k.size() + v.size();
    (void)sum;
  } catch (const rondo::Error&) {
  }
  return 0;
}
