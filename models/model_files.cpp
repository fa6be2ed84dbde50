#include "models/model_files.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string_view>
#include <unordered_map>

#include "kernels/error.h"
#include "models/model.h"

namespace rondo::models {
namespace fs = std::filesystem;

TokenizerSpec tokenizer_spec_from_gguf(const GgufFile& f) {
  const std::string model = f.get_string("tokenizer.ggml.model");
  TokenizerSpec spec;
  if (model == "gpt2") {
    spec.kind = TokenizerKind::kByteLevelBpe;
  } else if (model == "llama") {
    spec.kind = TokenizerKind::kSentencePieceBpe;
  } else {
    throw Error(f.path() + ": tokenizer.ggml.model '" + model +
                "' is not supported (supported: gpt2 = byte-level BPE, llama = SentencePiece BPE)");
  }
  spec.tokens = f.get_strings("tokenizer.ggml.tokens");
  const std::int64_t n = static_cast<std::int64_t>(spec.tokens.size());
  if (f.has("tokenizer.ggml.merges"))
    for (const std::string& m : f.get_strings("tokenizer.ggml.merges")) {
      std::size_t space = m.find(' ');
      if (space == std::string::npos || space == 0 || space + 1 >= m.size())
        throw Error(f.path() + ": tokenizer.ggml.merges holds '" + m +
                    "', which is not two tokens separated by a space");
      spec.merges.emplace_back(m.substr(0, space), m.substr(space + 1));
    }
  if (f.has("tokenizer.ggml.scores"))
    for (double s : f.get_floats("tokenizer.ggml.scores"))
      spec.scores.push_back(static_cast<float>(s));
  if (f.has("tokenizer.ggml.token_type")) {
    std::vector<std::int64_t> types = f.get_ints("tokenizer.ggml.token_type");
    if (static_cast<std::int64_t>(types.size()) != n)
      throw Error(f.path() + ": tokenizer.ggml.token_type has " + std::to_string(types.size()) +
                  " entries for " + std::to_string(n) + " tokens");
    // llama.cpp's types: 2 unknown (<unk>), 3 control (<s>, <|im_start|>), 4 user defined.
    // Unknown counts as special, as in the tokenizer.json transformers writes for these models:
    // "<unk>" in text is the token, and decode(skip_special_tokens) drops it.
    for (std::int64_t id = 0; id < n; ++id) {
      const auto i = static_cast<std::size_t>(id);
      if (types[i] == 2 || types[i] == 3) spec.special_ids.push_back(static_cast<std::int32_t>(id));
      if (types[i] == 4) spec.added_ids.push_back(static_cast<std::int32_t>(id));
    }
  }
  auto id = [&](const char* key) -> std::int32_t {
    if (!f.has(key)) return -1;
    std::int64_t v = f.get_int(key);
    if (v < 0 || v >= n)
      throw Error(f.path() + ": " + key + " = " + std::to_string(v) + " is not a token id (" +
                  std::to_string(n) + " tokens)");
    return static_cast<std::int32_t>(v);
  };
  spec.bos_id = id("tokenizer.ggml.bos_token_id");
  spec.eos_id = id("tokenizer.ggml.eos_token_id");
  spec.unk_id = id("tokenizer.ggml.unknown_token_id");
  spec.add_bos =
      f.get_bool("tokenizer.ggml.add_bos_token", spec.kind == TokenizerKind::kSentencePieceBpe);
  spec.add_eos = f.get_bool("tokenizer.ggml.add_eos_token", false);
  spec.add_space_prefix = f.get_bool("tokenizer.ggml.add_space_prefix", true);
  if (spec.kind == TokenizerKind::kByteLevelBpe) {
    const std::string pre = f.get_string("tokenizer.ggml.pre", "default");
    if (pre == "llama-bpe" || pre == "llama3") {
      spec.split_regexes = {std::string(kSplitRegexLlama3)};
      spec.ignore_merges = true;
    } else if (pre == "qwen2") {
      spec.split_regexes = {std::string(kSplitRegexQwen2)};
      spec.nfc = true;
    } else if (pre == "smollm") {
      spec.split_regexes = {R"(\p{N})"};
      spec.gpt2_split_after = true;
    } else if (pre == "gpt2" || pre == "gpt-2" || pre == "default") {
      // GPT-2's built-in split.
    } else {
      throw Error(f.path() + ": tokenizer.ggml.pre '" + pre +
                  "' is not supported (supported: llama-bpe, qwen2, smollm, gpt2, default)");
    }
  }
  return spec;
}

Tokenizer tokenizer_from_gguf(const GgufFile& f) {
  return Tokenizer::from_spec(tokenizer_spec_from_gguf(f), f.path());
}

std::string tokenizer_json(const TokenizerSpec& spec, const std::string& source) {
  // Plain (sorted) JSON objects: key order means nothing to tokenizers, and ordered_json looks
  // keys up one by one, which for a 150k vocabulary takes minutes.
  using json = nlohmann::json;
  if (spec.kind != TokenizerKind::kByteLevelBpe)
    throw Error(source +
                ": a SentencePiece tokenizer cannot be written as tokenizer.json by Rondo yet; "
                "export the adapter, or --format gguf");
  auto token = [&](std::int32_t id) { return spec.tokens[static_cast<std::size_t>(id)]; };
  std::vector<bool> added(spec.tokens.size(), false);
  json added_tokens = json::array();
  std::vector<std::pair<std::int32_t, bool>> extra;  // id, special
  for (std::int32_t id : spec.special_ids)
    extra.emplace_back(id, true);
  for (std::int32_t id : spec.added_ids)
    extra.emplace_back(id, false);
  std::sort(extra.begin(), extra.end());
  for (const auto& [id, special] : extra) {
    added[static_cast<std::size_t>(id)] = true;
    added_tokens.push_back({{"id", id},
                            {"content", token(id)},
                            {"single_word", false},
                            {"lstrip", false},
                            {"rstrip", false},
                            {"normalized", false},
                            {"special", special}});
  }
  // Every token in the model's vocabulary (added ones too, as transformers' own files do for
  // Llama 3): one id per string.
  std::unordered_map<std::string_view, std::size_t> first_id;
  first_id.reserve(spec.tokens.size());
  json vocab = json::object();
  for (std::size_t id = 0; id < spec.tokens.size(); ++id) {
    const auto [it, fresh] = first_id.emplace(spec.tokens[id], id);
    if (!fresh) {
      if (added[id]) continue;  // matched as an added token first
      throw Error(source + ": token '" + spec.tokens[id] +
                  "' appears twice in the vocabulary (ids " + std::to_string(it->second) + " and " +
                  std::to_string(id) + "); tokenizer.json cannot hold that");
    }
    vocab[spec.tokens[id]] = id;
  }
  json merges = json::array();
  for (const auto& [a, b] : spec.merges)
    merges.push_back({a, b});
  json pre = json::array();
  for (const std::string& r : spec.split_regexes)
    pre.push_back({{"type", "Split"},
                   {"pattern", {{"Regex", r}}},
                   {"behavior", "Isolated"},
                   {"invert", false}});
  pre.push_back({{"type", "ByteLevel"},
                 {"add_prefix_space", false},
                 {"trim_offsets", true},
                 {"use_regex", spec.split_regexes.empty() || spec.gpt2_split_after}});
  json post = nullptr;
  if (spec.add_bos || spec.add_eos) {
    json single = json::array(), pair = json::array(), specials = json::object();
    auto special = [&](std::int32_t id, int type_id) {
      specials[token(id)] = {{"id", token(id)}, {"ids", {id}}, {"tokens", {token(id)}}};
      return json{{"SpecialToken", {{"id", token(id)}, {"type_id", type_id}}}};
    };
    for (int seq = 0; seq < 2; ++seq) {
      json& out = seq == 0 ? single : pair;
      for (int part = 0; part <= seq; ++part) {
        if (spec.add_bos && spec.bos_id >= 0) out.push_back(special(spec.bos_id, part));
        out.push_back({{"Sequence", {{"id", part == 0 ? "A" : "B"}, {"type_id", part}}}});
        if (spec.add_eos && spec.eos_id >= 0) out.push_back(special(spec.eos_id, part));
      }
    }
    post = {{"type", "TemplateProcessing"},
            {"single", single},
            {"pair", pair},
            {"special_tokens", specials}};
  }
  const json out = {{"version", "1.0"},
                    {"truncation", nullptr},
                    {"padding", nullptr},
                    {"added_tokens", added_tokens},
                    {"normalizer", spec.nfc ? json{{"type", "NFC"}} : json(nullptr)},
                    {"pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", pre}}},
                    {"post_processor", post},
                    {"decoder",
                     {{"type", "ByteLevel"},
                      {"add_prefix_space", true},
                      {"trim_offsets", true},
                      {"use_regex", true}}},
                    {"model",
                     {{"type", "BPE"},
                      {"dropout", nullptr},
                      {"unk_token", spec.unk_id >= 0 ? json(token(spec.unk_id)) : json(nullptr)},
                      {"continuing_subword_prefix", nullptr},
                      {"end_of_word_suffix", nullptr},
                      {"fuse_unk", false},
                      {"byte_fallback", false},
                      {"ignore_merges", spec.ignore_merges},
                      {"vocab", vocab},
                      {"merges", merges}}}};
  return out.dump(2) + "\n";
}

std::string tokenizer_config_json(const TokenizerSpec& spec, const GgufFile& file,
                                  std::int64_t model_max_length) {
  using json = nlohmann::ordered_json;
  auto token = [&](std::int32_t id) {
    return id >= 0 ? json(spec.tokens[static_cast<std::size_t>(id)]) : json(nullptr);
  };
  json out = {{"tokenizer_class", "PreTrainedTokenizerFast"},
              {"bos_token", token(spec.bos_id)},
              {"eos_token", token(spec.eos_id)},
              {"unk_token", token(spec.unk_id)},
              {"add_bos_token", spec.add_bos},
              {"add_eos_token", spec.add_eos},
              {"clean_up_tokenization_spaces", false},
              {"model_max_length", model_max_length}};
  if (file.has("tokenizer.chat_template"))
    out["chat_template"] = file.get_string("tokenizer.chat_template");
  return out.dump(2) + "\n";
}

Tokenizer load_tokenizer(const std::string& model_path) {
  if (model_format(model_path) == ModelFormat::kHfFolder) {
    fs::path p = fs::path(model_path) / "tokenizer.json";
    if (!fs::exists(p))
      throw Error(model_path +
                  " has no tokenizer.json (Rondo reads Hugging Face fast-tokenizer "
                  "files; re-save the tokenizer with transformers to create one)");
    return Tokenizer::from_file(p.string());
  }
  return tokenizer_from_gguf(GgufFile(model_path));
}

ChatTemplate load_model_chat_template(const std::string& model_path, const std::string& format) {
  if (!format.empty()) return chat_template_from_name(format);
  if (model_format(model_path) == ModelFormat::kHfFolder) {
    fs::path p = fs::path(model_path) / "tokenizer_config.json";
    if (!fs::exists(p))
      throw Error(model_path +
                  " has no tokenizer_config.json with a chat template; choose a "
                  "format with --chat-format chatml|qwen3|llama3|llama3.1|mistral|mistral-v1");
    return load_chat_template(p.string());
  }
  GgufFile f(model_path);
  if (!f.has("tokenizer.chat_template"))
    throw Error(model_path +
                " has no tokenizer.chat_template; choose a format with "
                "--chat-format chatml|qwen3|llama3|llama3.1|mistral|mistral-v1");
  return recognise_chat_template(f.get_string("tokenizer.chat_template"),
                                 model_path + " (tokenizer.chat_template)");
}

}  // namespace rondo::models
