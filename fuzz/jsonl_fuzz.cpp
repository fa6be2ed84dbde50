// JSONL training data: the input is a data file, read in every format with bad lines skipped and
// counted (and once without skipping), through a byte tokenizer and the ChatML template; as
// preference pairs for each preference objective too. The reader
// either returns examples whose masks match their ids or throws rondo::Error naming the file.
#include <cstdint>
#include <string>

#include "engine/data.h"
#include "fuzz_file.h"
#include "kernels/error.h"
#include "models/chat_template.h"
#include "models/tokenizer.h"

namespace {

const rondo::models::Tokenizer& tokenizer() {
  static const rondo::models::Tokenizer t = [] {
    std::string vocab = "{";
    for (int b = 0; b < 256; ++b) {
      char name[24];
      std::snprintf(name, sizeof name, "\"<0x%02X>\":%d,", b, b);
      vocab += name;
    }
    vocab += "\"<|im_start|>\":256,\"<|im_end|>\":257}";
    return rondo::models::Tokenizer::from_json(
        "{\"added_tokens\":[{\"id\":256,\"content\":\"<|im_start|>\",\"special\":true},"
        "{\"id\":257,\"content\":\"<|im_end|>\",\"special\":true}],"
        "\"model\":{\"type\":\"BPE\",\"byte_fallback\":true,\"vocab\":" +
            vocab + ",\"merges\":[]}}",
        "fuzz tokenizer");
  }();
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = rondo::fuzz::write_input(data, size, ".jsonl");
  static const rondo::models::ChatTemplate chatml =
      rondo::models::chat_template_from_name("chatml");
  using rondo::engine::DataFormat;
  using rondo::engine::Objective;
  for (DataFormat f : rondo::engine::kDataFormats) {
    // Pairs are read for a preference objective, each objective tokenising them its own way.
    const bool pairs = f == DataFormat::kPreference || f == DataFormat::kAuto;
    for (Objective o : {Objective::kSft, Objective::kDpo, Objective::kOrpo, Objective::kSimpo}) {
      if (o != Objective::kSft && !pairs) continue;
      for (bool skip : {true, false}) {
        try {
          const rondo::engine::Dataset d = rondo::engine::load_data(path, tokenizer(), chatml,
                                                                    {.format = f,
                                                                     .skip_bad_lines = skip,
                                                                     .objective = o,
                                                                     .max_length = 48,
                                                                     .max_line_bytes = 1 << 16});
          for (const rondo::engine::Example& e : d.examples) {
            if (e.ids.empty() || e.ids.size() != e.loss_mask.size()) __builtin_trap();
            if (e.second < 0 || static_cast<std::size_t>(e.second) > e.ids.size()) __builtin_trap();
            if (o != Objective::kSft && (e.second == 0 || e.ids.size() > 2 * 48)) __builtin_trap();
          }
          (void)d.stats_text();
        } catch (const rondo::Error&) {
        }
      }
    }
  }
  return 0;
}
