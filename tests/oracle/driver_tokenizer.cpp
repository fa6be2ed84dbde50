// Oracle driver commands for tokenizers and chat templates (tests/oracle/test_tokenizer.py,
// test_chat_template.py): Rondo encodes, decodes and renders; pytest compares with `tokenizers`
// and `transformers`.
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "driver.h"
#include "kernels/error.h"
#include "models/chat_template.h"
#include "models/model_files.h"
#include "models/tokenizer.h"

namespace rondo::oracle {
namespace {

using nlohmann::json;

json read_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  return json::parse(ss.str());
}

void write_json(const std::string& path, const json& j) {
  std::ofstream out(path, std::ios::binary);
  out << j.dump();
  if (!out) throw Error(path + ": cannot write");
}

json optional_id(std::optional<std::int32_t> id) {
  return id ? json(*id) : json(nullptr);
}

// in.json: {"texts": [...], "decode_ids": [[...], ...]}. out.json: per text the ids without and
// with the post-processor's special tokens, the offsets, and decodes; decodes of decode_ids.
json run_tokenizer(const models::Tokenizer& tok, const json& in) {
  json out;
  out["vocab_size"] = tok.vocab_size();
  out["bos_id"] = optional_id(tok.bos_id());
  out["eos_id"] = optional_id(tok.eos_id());
  json ids = json::array(), ids_special = json::array(), offsets = json::array(),
       decoded = json::array(), decoded_skip = json::array();
  for (const json& t : in.at("texts")) {
    const std::string text = t.get<std::string>();
    const models::Tokenizer::Encoding enc = tok.encode_with_offsets(text);
    ids.push_back(enc.ids);
    json offs = json::array();
    for (auto [b, e] : enc.offsets)
      offs.push_back({b, e});
    offsets.push_back(offs);
    const std::vector<std::int32_t> with_special = tok.encode(text, true);
    ids_special.push_back(with_special);
    decoded.push_back(tok.decode(enc.ids, false));
    decoded_skip.push_back(tok.decode(with_special, true));
  }
  out["ids"] = ids;
  out["ids_special"] = ids_special;
  out["offsets"] = offsets;
  out["decoded"] = decoded;
  out["decoded_skip"] = decoded_skip;
  json raw = json::array(), raw_skip = json::array();
  if (in.contains("decode_ids"))
    for (const json& list : in.at("decode_ids")) {
      const auto v = list.get<std::vector<std::int32_t>>();
      raw.push_back(tok.decode(v, false));
      raw_skip.push_back(tok.decode(v, true));
    }
  out["decode_ids"] = raw;
  out["decode_ids_skip"] = raw_skip;
  json special = json::array();
  for (std::int64_t id = 0; id < tok.vocab_size(); ++id)
    if (tok.is_special(static_cast<std::int32_t>(id))) special.push_back(id);
  out["special_ids"] = special;
  return out;
}

// <tokenizer>: a tokenizer.json, or a model (folder or .gguf) whose tokenizer to use.
int tokenize(const std::vector<std::string>& args) {
  if (args.size() != 3) throw Error("usage: tokenize <tokenizer.json|model> <in.json> <out.json>");
  const std::string& path = args[0];
  const bool json_file = path.size() > 5 && path.compare(path.size() - 5, 5, ".json") == 0;
  const models::Tokenizer tok =
      json_file ? models::Tokenizer::from_file(path) : models::load_tokenizer(path);
  write_json(args[2], run_tokenizer(tok, read_json(args[1])));
  return 0;
}
const RegisterCommand kTokenize("tokenize", "<tokenizer.json|model> <in.json> <out.json>",
                                tokenize);

// spec.json: the fields of models::TokenizerSpec.
int tokenize_spec(const std::vector<std::string>& args) {
  if (args.size() != 3) throw Error("usage: tokenize-spec <spec.json> <in.json> <out.json>");
  const json j = read_json(args[0]);
  models::TokenizerSpec spec;
  spec.kind = j.at("kind") == "sentencepiece" ? models::TokenizerKind::kSentencePieceBpe
                                              : models::TokenizerKind::kByteLevelBpe;
  spec.tokens = j.at("tokens").get<std::vector<std::string>>();
  for (const json& m : j.value("merges", json::array()))
    spec.merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
  spec.scores = j.value("scores", std::vector<float>{});
  spec.special_ids = j.value("special_ids", std::vector<std::int32_t>{});
  spec.added_ids = j.value("added_ids", std::vector<std::int32_t>{});
  spec.split_regexes = j.value("split_regexes", std::vector<std::string>{});
  spec.gpt2_split_after = j.value("gpt2_split_after", false);
  spec.nfc = j.value("nfc", false);
  spec.ignore_merges = j.value("ignore_merges", false);
  spec.byte_fallback = j.value("byte_fallback", true);
  spec.add_space_prefix = j.value("add_space_prefix", true);
  spec.unk_id = j.value("unk_id", -1);
  spec.bos_id = j.value("bos_id", -1);
  spec.eos_id = j.value("eos_id", -1);
  spec.add_bos = j.value("add_bos", false);
  spec.add_eos = j.value("add_eos", false);
  const models::Tokenizer tok = models::Tokenizer::from_spec(spec, args[0]);
  write_json(args[2], run_tokenizer(tok, read_json(args[1])));
  return 0;
}
const RegisterCommand kTokenizeSpec("tokenize-spec", "<spec.json> <in.json> <out.json>",
                                    tokenize_spec);

// conversation.json: {"messages": [{"role", "content"}...], "add_generation_prompt": bool,
// "format": "" (recognise from tokenizer_config.json) or a name}.
int chat(const std::vector<std::string>& args) {
  if (args.size() != 4)
    throw Error(
        "usage: chat <tokenizer.json> <tokenizer_config.json> <conversation.json> <out.json>");
  const models::Tokenizer tok = models::Tokenizer::from_file(args[0]);
  const json conv = read_json(args[2]);
  const std::string format = conv.value("format", std::string());
  const models::ChatTemplate tmpl = format.empty() ? models::load_chat_template(args[1])
                                                   : models::chat_template_from_name(format);
  std::vector<models::ChatMessage> messages;
  for (const json& m : conv.at("messages"))
    messages.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
  const models::RenderedChat r =
      models::render_chat(tok, tmpl, messages, conv.value("add_generation_prompt", false));
  json out;
  out["format"] = models::to_string(tmpl.format);
  out["text"] = r.text;
  out["ids"] = r.ids;
  std::vector<int> mask(r.loss_mask.begin(), r.loss_mask.end());
  out["mask"] = mask;
  write_json(args[3], out);
  return 0;
}
const RegisterCommand kChat(
    "chat", "<tokenizer.json> <tokenizer_config.json> <conversation.json> <out.json>", chat);

}  // namespace
}  // namespace rondo::oracle
