// Reading a Hugging Face tokenizer.json into a tokenizer's pipeline (Tokenizer::from_json,
// from_file), and the tokenizer_config.json beside it. Touches the files it is given and the
// pipeline it builds; used through Tokenizer (tokenizer.h) and by chat templates
// (read_tokenizer_config).
//
// The JSON text itself is parsed by nlohmann::json; what is ours is the walk over the parsed
// document, kept by hand rather than through nlohmann's get<T>() / from_json because every error
// must name the file and the JSON path of the construct ("tokenizer.json: pre_tokenizer.
// pretokenizers[1].behavior: ..."), say what is supported instead, and refuse ids that a plain
// get<std::int32_t>() would silently truncate. fuzz/tokenizer_fuzz.cpp runs it on arbitrary input.
#include <algorithm>
#include <filesystem>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "kernels/error.h"
#include "models/mapped_file.h"
#include "models/tokenizer.h"
#include "models/tokenizer_config.h"
#include "models/tokenizer_pipeline.h"
#include "models/unicode.h"

namespace rondo::models {
namespace {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// tokenizer.json parsing. Every error names the file and the JSON path of the construct.

struct Parser {
  const std::string& source;
  // Ids run 0 .. id_limit - 1: model.vocab and added_tokens cannot hold more distinct ids than
  // they have entries, so a larger id is a corrupt file (and would size id_to_token by it).
  std::int64_t id_limit = 0;

  [[noreturn]] void fail(const std::string& path, const std::string& msg) const {
    throw Error(source + ": " + path + ": " + msg);
  }
  const json& field(const json& obj, const std::string& path, const char* key) const {
    if (!obj.is_object() || !obj.contains(key))
      fail(path, std::string("missing field '") + key + "'");
    return obj.at(key);
  }
  std::string str(const json& obj, const std::string& path, const char* key) const {
    const json& v = field(obj, path, key);
    if (!v.is_string()) fail(path + "." + key, "expected a string, got " + v.dump());
    return v.get<std::string>();
  }
  bool flag(const json& obj, const std::string& path, const char* key, bool fallback) const {
    if (!obj.contains(key) || obj.at(key).is_null()) return fallback;
    if (!obj.at(key).is_boolean()) fail(path + "." + key, "expected true or false");
    return obj.at(key).get<bool>();
  }
  std::string type_of(const json& obj, const std::string& path) const {
    if (!obj.is_object()) fail(path, "expected an object, got " + obj.dump().substr(0, 80));
    return str(obj, path, "type");
  }
  const json& list(const json& obj, const std::string& path, const char* key) const {
    const json& v = field(obj, path, key);
    if (!v.is_array()) fail(path + "." + key, "expected a list");
    return v;
  }

  // A JSON integer >= 0 as the number it is: get<std::int32_t>() would truncate 5000000000 to
  // 705032704 and wrap 4294967295 to -1.
  static std::optional<std::uint64_t> non_negative(const json& v) {
    if (v.is_number_unsigned()) return v.get<std::uint64_t>();
    if (v.is_number_integer() && v.get<std::int64_t>() >= 0)
      return static_cast<std::uint64_t>(v.get<std::int64_t>());
    return std::nullopt;
  }

  // A token id in 0 .. id_limit - 1, checked before narrowing.
  std::int32_t token_id(const json& v, const std::string& path) const {
    const auto id = non_negative(v);
    if (!id) fail(path, "expected a token id (an integer >= 0), got " + v.dump());
    if (*id >= static_cast<std::uint64_t>(id_limit))
      fail(path, "id " + std::to_string(*id) + " is outside 0.." + std::to_string(id_limit - 1) +
                     " (model.vocab and added_tokens hold " + std::to_string(id_limit) +
                     " entries); the file is corrupt");
    return static_cast<std::int32_t>(*id);
  }

  // An id the post-processor adds: it must be a token of the vocabulary or added_tokens (both are
  // parsed by then), or decode and chat templates would meet an id without a token.
  std::int32_t used_id(const json& v, const std::string& path, const Tokenizer::Impl& t) const;

  Pattern pattern(const json& obj, const std::string& path) const {
    const json& p = field(obj, path, "pattern");
    Pattern out;
    if (p.is_object() && p.contains("String") && p.at("String").is_string()) {
      out.literal = p.at("String").get<std::string>();
    } else if (p.is_object() && p.contains("Regex") && p.at("Regex").is_string()) {
      out.regex = std::make_shared<Regex>(p.at("Regex").get<std::string>(),
                                          source + ": " + path + ".pattern");
    } else {
      fail(path + ".pattern", "expected {\"String\": ...} or {\"Regex\": ...}, got " + p.dump());
    }
    return out;
  }

  void normalizer(const json& n, const std::string& path, std::vector<NormStep>& out) const {
    if (n.is_null()) return;
    const std::string type = type_of(n, path);
    if (type == "Sequence") {
      const json& items = list(n, path, "normalizers");
      for (std::size_t i = 0; i < items.size(); ++i)
        normalizer(items[i], path + ".normalizers[" + std::to_string(i) + "]", out);
    } else if (type == "Prepend") {
      out.emplace_back(NormPrepend{str(n, path, "prepend")});
    } else if (type == "Replace") {
      out.emplace_back(NormReplace{pattern(n, path), str(n, path, "content")});
    } else if (type == "NFC" || type == "NFD") {
      out.emplace_back(NormUnicode{type == "NFC"});
    } else if (type == "Strip") {
      out.emplace_back(
          NormStrip{flag(n, path, "strip_left", true), flag(n, path, "strip_right", true)});
    } else {
      fail(path + ".type", "normalizer '" + type +
                               "' is not supported (supported: Sequence, Prepend, Replace, NFC, "
                               "NFD, Strip)");
    }
  }

  PrependScheme scheme(const json& n, const std::string& path) const {
    if (n.contains("prepend_scheme") && !n.at("prepend_scheme").is_null()) {
      const std::string s = str(n, path, "prepend_scheme");
      if (s == "first") return PrependScheme::kFirst;
      if (s == "always") return PrependScheme::kAlways;
      if (s == "never") return PrependScheme::kNever;
      fail(path + ".prepend_scheme", "'" + s + "' is not one of first, always, never");
    }
    return flag(n, path, "add_prefix_space", true) ? PrependScheme::kAlways : PrependScheme::kNever;
  }

  std::string replacement(const json& n, const std::string& path) const {
    const std::string r = n.contains("replacement") ? str(n, path, "replacement") : "\xE2\x96\x81";
    std::size_t i = 0;
    if (r.empty() || (unicode::next(r, i), i != r.size()))
      fail(path + ".replacement", "must be one character, got " + json(r).dump());
    return r;
  }

  void pre_tokenizer(const json& n, const std::string& path, std::vector<PreStep>& out) const {
    if (n.is_null()) return;
    const std::string type = type_of(n, path);
    if (type == "Sequence") {
      const json& items = list(n, path, "pretokenizers");
      for (std::size_t i = 0; i < items.size(); ++i)
        pre_tokenizer(items[i], path + ".pretokenizers[" + std::to_string(i) + "]", out);
    } else if (type == "Split") {
      PreSplit s;
      s.pattern = pattern(n, path);
      const std::string b = str(n, path, "behavior");
      if (b == "Removed")
        s.behavior = SplitBehavior::kRemoved;
      else if (b == "Isolated")
        s.behavior = SplitBehavior::kIsolated;
      else if (b == "MergedWithPrevious")
        s.behavior = SplitBehavior::kMergedWithPrevious;
      else if (b == "MergedWithNext")
        s.behavior = SplitBehavior::kMergedWithNext;
      else if (b == "Contiguous")
        s.behavior = SplitBehavior::kContiguous;
      else
        fail(path + ".behavior", "'" + b +
                                     "' is not one of Removed, Isolated, MergedWithPrevious, "
                                     "MergedWithNext, Contiguous");
      s.invert = flag(n, path, "invert", false);
      out.push_back(std::move(s));
    } else if (type == "ByteLevel") {
      out.push_back(
          PreByteLevel{flag(n, path, "add_prefix_space", false), flag(n, path, "use_regex", true)});
    } else if (type == "Metaspace") {
      out.push_back(
          PreMetaspace{replacement(n, path), scheme(n, path), flag(n, path, "split", true)});
    } else if (type == "Digits") {
      PreSplit s;
      s.pattern.regex = std::make_shared<Regex>(R"(\p{N})", source + ": " + path);
      s.behavior = flag(n, path, "individual_digits", false) ? SplitBehavior::kIsolated
                                                             : SplitBehavior::kContiguous;
      out.push_back(std::move(s));
    } else {
      fail(path + ".type", "pre-tokenizer '" + type +
                               "' is not supported (supported: Sequence, Split, ByteLevel, "
                               "Metaspace, Digits)");
    }
  }

  void decoder(const json& n, const std::string& path, std::vector<DecStep>& out) const {
    const std::string type = type_of(n, path);
    if (type == "Sequence") {
      const json& items = list(n, path, "decoders");
      for (std::size_t i = 0; i < items.size(); ++i)
        decoder(items[i], path + ".decoders[" + std::to_string(i) + "]", out);
    } else if (type == "ByteLevel") {
      out.push_back(DecByteLevel{});
    } else if (type == "Replace") {
      out.push_back(DecReplace{pattern(n, path), str(n, path, "content")});
    } else if (type == "ByteFallback") {
      out.push_back(DecByteFallback{});
    } else if (type == "Fuse") {
      out.push_back(DecFuse{});
    } else if (type == "Strip") {
      const std::string c = str(n, path, "content");
      std::size_t i = 0;
      if (c.empty() || (unicode::next(c, i), i != c.size()))
        fail(path + ".content", "must be one character");
      std::size_t j = 0;
      const json& start = field(n, path, "start");
      const json& stop = field(n, path, "stop");
      if (!start.is_number_unsigned() || !stop.is_number_unsigned())
        fail(path, "start and stop must be non-negative integers");
      out.push_back(
          DecStrip{unicode::next(c, j), start.get<std::size_t>(), stop.get<std::size_t>()});
    } else if (type == "Metaspace") {
      out.push_back(DecMetaspace{replacement(n, path), scheme(n, path)});
    } else {
      fail(path + ".type", "decoder '" + type +
                               "' is not supported (supported: Sequence, ByteLevel, Replace, "
                               "ByteFallback, Fuse, Strip, Metaspace)");
    }
  }

  // Template items of a post-processor (ids only: type ids and pairs do not matter here).
  void post_processor(const json& n, const std::string& path, Tokenizer::Impl& t) const {
    if (n.is_null()) return;
    const std::string type = type_of(n, path);
    auto special = [&](const std::string& content, const std::string& where) {
      auto id = t.added_by_content.find(content);
      if (id != t.added_by_content.end()) return id->second;
      auto v = t.model.vocab.find(content);
      if (v != t.model.vocab.end()) return v->second;
      fail(where, "token " + json(content).dump() + " is not in the vocabulary");
    };
    if (type == "Sequence") {
      const json& items = list(n, path, "processors");
      for (std::size_t i = 0; i < items.size(); ++i)
        post_processor(items[i], path + ".processors[" + std::to_string(i) + "]", t);
    } else if (type == "ByteLevel") {
      // Offsets only; ids unchanged.
    } else if (type == "TemplateProcessing") {
      const json& single = list(n, path, "single");
      const json& specials = n.contains("special_tokens") ? n.at("special_tokens") : json::object();
      std::vector<PostItem> items;
      for (std::size_t i = 0; i < single.size(); ++i) {
        const std::string where = path + ".single[" + std::to_string(i) + "]";
        const json& item = single[i];
        if (item.contains("Sequence")) {
          items.push_back({true, {}});
        } else if (item.contains("SpecialToken")) {
          const std::string id = str(item.at("SpecialToken"), where + ".SpecialToken", "id");
          PostItem p;
          if (specials.contains(id) && specials.at(id).contains("ids")) {
            const std::string ids_path = path + ".special_tokens." + id + ".ids";
            const json& ids = specials.at(id).at("ids");
            if (!ids.is_array()) fail(ids_path, "expected a list of token ids");
            for (std::size_t k = 0; k < ids.size(); ++k)
              p.ids.push_back(used_id(ids[k], ids_path + "[" + std::to_string(k) + "]", t));
          } else {
            p.ids.push_back(special(id, where));
          }
          items.push_back(std::move(p));
        } else {
          fail(where, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
        }
      }
      t.post = std::move(items);
    } else if (type == "RobertaProcessing" || type == "BertProcessing") {
      auto token = [&](const char* key) {
        const json& v = field(n, path, key);
        if (!v.is_array() || v.size() != 2 || !v[0].is_string())
          fail(path + "." + key, "expected [token, id]");
        return used_id(v[1], path + "." + key + "[1]", t);
      };
      t.post = {{false, {token("cls")}}, {true, {}}, {false, {token("sep")}}};
    } else {
      fail(path + ".type", "post-processor '" + type +
                               "' is not supported (supported: Sequence, ByteLevel, "
                               "TemplateProcessing, RobertaProcessing, BertProcessing)");
    }
  }

  void model(const json& m, Tokenizer::Impl& t) const {
    const std::string type = type_of(m, "model");
    if (type != "BPE") fail("model.type", "model '" + type + "' is not supported (supported: BPE)");
    if (m.contains("dropout") && !m.at("dropout").is_null() &&
        !(m.at("dropout").is_number() && m.at("dropout").get<double>() == 0.0))
      fail("model.dropout", "BPE dropout makes encoding random; set it to null for inference");
    const json& vocab = field(m, "model", "vocab");
    if (!vocab.is_object()) fail("model.vocab", "expected an object {token: id}");
    BpeModel& bpe = t.model;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      const std::int32_t id = token_id(it.value(), "model.vocab." + it.key());
      bpe.vocab[it.key()] = id;
      t.set_id(id, it.key());
    }
    auto opt_str = [&](const char* key) {
      return m.contains(key) && !m.at(key).is_null() ? str(m, "model", key) : std::string();
    };
    bpe.continuing_subword_prefix = opt_str("continuing_subword_prefix");
    bpe.end_of_word_suffix = opt_str("end_of_word_suffix");
    const json& merges = list(m, "model", "merges");
    for (std::size_t i = 0; i < merges.size(); ++i) {
      const json& e = merges[i];
      std::string a, b;
      if (e.is_string()) {
        const std::string s = e.get<std::string>();
        const std::size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          fail("model.merges[" + std::to_string(i) + "]",
               "expected \"left right\" with one space, got " + e.dump());
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        a = e[0].get<std::string>();
        b = e[1].get<std::string>();
      } else {
        fail("model.merges[" + std::to_string(i) + "]", "expected \"a b\" or [\"a\", \"b\"]");
      }
      bpe.add_merge(a, b, static_cast<std::int32_t>(i), source,
                    "model.merges[" + std::to_string(i) + "]");
    }
    bpe.fuse_unk = flag(m, "model", "fuse_unk", false);
    bpe.byte_fallback = flag(m, "model", "byte_fallback", false);
    bpe.ignore_merges = flag(m, "model", "ignore_merges", false);
    const std::string unk = opt_str("unk_token");
    if (!unk.empty()) {
      auto it = bpe.vocab.find(unk);
      if (it == bpe.vocab.end())
        fail("model.unk_token", "unknown token " + json(unk).dump() + " is not in model.vocab");
      bpe.unk_id = it->second;
    }
    bpe.fill_byte_ids();
  }

  void added_tokens(const json& list_json, Tokenizer::Impl& t) const {
    if (list_json.is_null()) return;
    if (!list_json.is_array()) fail("added_tokens", "expected a list");
    for (std::size_t i = 0; i < list_json.size(); ++i) {
      const std::string path = "added_tokens[" + std::to_string(i) + "]";
      const json& a = list_json[i];
      AddedToken tok;
      tok.id = token_id(field(a, path, "id"), path + ".id");
      tok.content = str(a, path, "content");
      tok.special = flag(a, path, "special", false);
      tok.lstrip = flag(a, path, "lstrip", false);
      tok.rstrip = flag(a, path, "rstrip", false);
      tok.single_word = flag(a, path, "single_word", false);
      tok.normalized = flag(a, path, "normalized", !tok.special);
      t.added.push_back(std::move(tok));
    }
  }
};

std::int32_t Parser::used_id(const json& v, const std::string& path,
                             const Tokenizer::Impl& t) const {
  const auto id = non_negative(v);
  if (!id) fail(path, "expected a token id (an integer >= 0), got " + v.dump());
  if (*id >= t.id_to_token.size() || !t.id_used[*id])
    fail(path, "id " + std::to_string(*id) + " is not the id of a token in model.vocab or " +
                   "added_tokens");
  return static_cast<std::int32_t>(*id);
}

// A token given in tokenizer_config.json as "<s>" or {"content": "<s>", ...}.
std::optional<std::string> config_token(const json& cfg, const char* key) {
  if (!cfg.contains(key)) return std::nullopt;
  const json& v = cfg.at(key);
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v.at("content").is_string())
    return v.at("content").get<std::string>();
  return std::nullopt;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

Tokenizer Tokenizer::from_json(const std::string& json_text, const std::string& source) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number too large
    throw Error(source + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw Error(source + ": expected a JSON object (a tokenizer.json)");
  auto impl = std::make_shared<Impl>();
  impl->source = source;
  Parser p{source};
  if (!j.contains("model")) p.fail("model", "missing (is this a Hugging Face tokenizer.json?)");
  const json& m = j.at("model");
  std::size_t entries = 0;
  if (m.is_object() && m.contains("vocab") && m.at("vocab").is_object())
    entries += m.at("vocab").size();
  if (j.contains("added_tokens") && j.at("added_tokens").is_array())
    entries += j.at("added_tokens").size();
  p.id_limit = static_cast<std::int64_t>(
      std::min<std::size_t>(entries, std::numeric_limits<std::int32_t>::max()));
  p.model(m, *impl);
  if (j.contains("normalizer")) p.normalizer(j.at("normalizer"), "normalizer", impl->normalizer);
  if (j.contains("pre_tokenizer"))
    p.pre_tokenizer(j.at("pre_tokenizer"), "pre_tokenizer", impl->pre_tokenizer);
  if (j.contains("added_tokens")) p.added_tokens(j.at("added_tokens"), *impl);
  impl->finish_added();
  if (j.contains("post_processor"))
    p.post_processor(j.at("post_processor"), "post_processor", *impl);
  if (j.contains("decoder") && !j.at("decoder").is_null()) {
    impl->has_decoder = true;
    p.decoder(j.at("decoder"), "decoder", impl->decoder);
  }
  impl->kind = std::any_of(impl->pre_tokenizer.begin(), impl->pre_tokenizer.end(),
                           [](const PreStep& s) { return std::holds_alternative<PreByteLevel>(s); })
                   ? TokenizerKind::kByteLevelBpe
                   : TokenizerKind::kSentencePieceBpe;
  // BOS: the special token the template puts before the sequence.
  for (const PostItem& item : impl->post) {
    if (item.sequence) break;
    if (!item.ids.empty()) impl->bos = item.ids.front();
  }
  if (!impl->post.empty() && !impl->post.back().sequence && !impl->post.back().ids.empty())
    impl->eos = impl->post.back().ids.back();
  return Tokenizer(std::move(impl));
}

json read_tokenizer_config(const std::string& path) {
  json cfg;
  try {
    cfg = json::parse(read_text_file(path, "tokenizer config"));
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number too large
    throw Error(path + ": not valid JSON: " + e.what());
  }
  if (!cfg.is_object()) throw Error(path + ": expected a JSON object (a tokenizer_config.json)");
  return cfg;
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  Tokenizer t = from_json(read_text_file(path, "tokenizer", kTokenizerFileLimit), path);
  // bos/eos from a tokenizer_config.json beside it.
  const std::size_t slash = path.find_last_of('/');
  const std::string config =
      (slash == std::string::npos ? std::string() : path.substr(0, slash + 1)) +
      "tokenizer_config.json";
  std::error_code ec;
  if (!std::filesystem::exists(config, ec)) return t;
  const json cfg = read_tokenizer_config(config);
  auto impl = std::const_pointer_cast<Impl>(t.impl_);
  if (auto bos = config_token(cfg, "bos_token"))
    if (auto id = t.token_to_id(*bos)) impl->bos = *id;
  if (auto eos = config_token(cfg, "eos_token"))
    if (auto id = t.token_to_id(*eos)) impl->eos = *id;
  return t;
}

}  // namespace rondo::models
