// tokenizer.json loading and encoding. The input is a tokenizer.json, then a NUL byte, then text to
// encode (at most 4 KiB of it) and decode again. Loading either succeeds or throws rondo::Error;
// encoding valid UTF-8 with a loaded tokenizer gives ids the tokenizer can decode.
#include <cstdint>
#include <string>
#include <string_view>

#include "kernels/error.h"
#include "models/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const std::size_t nul = in.find('\0');
  const std::string json(in.substr(0, nul));
  const std::string text(nul == std::string_view::npos ? "" : in.substr(nul + 1, 4096));
  try {
    const rondo::models::Tokenizer t = rondo::models::Tokenizer::from_json(json, "fuzz");
    for (bool special : {false, true}) {
      const std::vector<std::int32_t> ids = t.encode(text, special);
      (void)t.decode(ids, /*skip_special_tokens=*/!special);
    }
  } catch (const rondo::Error&) {
  }
  return 0;
}
