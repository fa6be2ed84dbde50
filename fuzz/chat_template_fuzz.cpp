// The chat-template recogniser and renderer. The input is a Jinja chat template (what a
// tokenizer_config.json carries), then a NUL byte, then messages, one per line as "role: content".
// A recognised template renders them with a ChatML-and-Llama-3 test tokenizer, or says why not
// (rondo::Error).
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/error.h"
#include "models/chat_template.h"
#include "models/tokenizer.h"

namespace {

// Bytes as ids, plus the marker tokens of the formats Rondo renders.
const rondo::models::Tokenizer& tokenizer() {
  static const rondo::models::Tokenizer t = [] {
    std::string vocab = "{";
    int id = 0;
    for (int b = 0; b < 256; ++b) {
      char name[16];
      std::snprintf(name, sizeof name, "\"<0x%02X>\":%d,", b, id++);
      vocab += name;
    }
    std::string added = "[";
    for (const char* s : {"<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
                          "<|end_header_id|>", "<|eot_id|>", "[INST]", "[/INST]", "<s>", "</s>",
                          "<think>", "</think>"}) {
      vocab += "\"" + std::string(s) + "\":" + std::to_string(id) + ",";
      added += std::string(added.size() > 1 ? "," : "") + "{\"id\":" + std::to_string(id) +
               ",\"content\":\"" + s + "\",\"special\":true}";
      ++id;
    }
    vocab.back() = '}';
    added += "]";
    const std::string json =
        "{\"added_tokens\":" + added +
        ",\"model\":{\"type\":\"BPE\",\"byte_fallback\":true,\"vocab\":" + vocab +
        ",\"merges\":[]}}";
    return rondo::models::Tokenizer::from_json(json, "fuzz tokenizer");
  }();
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const std::size_t nul = in.find('\0');
  const std::string jinja(in.substr(0, nul));
  std::vector<rondo::models::ChatMessage> messages;
  if (nul != std::string_view::npos) {
    std::string_view rest = in.substr(nul + 1, 4096);
    while (!rest.empty()) {
      const std::size_t nl = rest.find('\n');
      const std::string_view line = rest.substr(0, nl);
      const std::size_t colon = line.find(": ");
      if (colon != std::string_view::npos)
        messages.push_back(
            {std::string(line.substr(0, colon)), std::string(line.substr(colon + 2))});
      if (nl == std::string_view::npos) break;
      rest.remove_prefix(nl + 1);
    }
  }
  try {
    const rondo::models::ChatTemplate tmpl = rondo::models::recognise_chat_template(jinja, "fuzz");
    for (bool gen : {false, true}) {
      const rondo::models::RenderedChat r =
          rondo::models::render_chat(tokenizer(), tmpl, messages, gen);
      if (r.ids.size() != r.loss_mask.size()) __builtin_trap();
    }
  } catch (const rondo::Error&) {
  }
  return 0;
}
