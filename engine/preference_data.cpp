// Preference pairs from TRL's layouts, tokenised as TRL 1.16 does (preference_data.h). The TRL
// code each step follows is cited from docs/preference-reference.md (DT: dpo_trainer.py, OT:
// orpo_trainer.py, DU: data_utils.py, EU: experimental/utils.py).
#include "engine/preference_data.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <utility>
#include <variant>
#include <vector>

#include "kernels/error.h"

namespace rondo::engine {
namespace {

using nlohmann::json;
using Messages = std::vector<models::ChatMessage>;
using Tokens = std::vector<std::int32_t>;

bool same(char a, char b) {
  return a == b;
}
bool same(const models::ChatMessage& a, const models::ChatMessage& b) {
  return a.role == b.role && a.content == b.content;
}

// One of prompt, chosen, rejected: a string or a list of messages.
using Part = std::variant<std::string, Messages>;

Part read_part(json& j, const char* key) {
  if (!j.contains(key)) throw Error(std::string("no '") + key + "' field");
  json& v = j[key];
  if (v.is_string()) return std::move(v.get_ref<std::string&>());
  if (!v.is_array())
    throw Error(std::string("'") + key + "' must be a string or a list of messages");
  Messages out;
  for (std::size_t i = 0; i < v.size(); ++i) {
    json& m = v[i];
    const std::string where = std::string(key) + "[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
        !m["content"].is_string())
      throw Error(where + " must be {\"role\": string, \"content\": string}");
    const std::string& role = m["role"].get_ref<const std::string&>();
    if (role != "system" && role != "user" && role != "assistant")
      throw Error(where + ".role is '" + role + "' (system, user or assistant)");
    out.push_back({role, std::move(m["content"].get_ref<std::string&>())});
  }
  return out;
}

bool conversational(const Part& p) {
  return std::holds_alternative<Messages>(p);
}

// TRL's extract_prompt (DU:548-632): the longest common start of chosen and rejected, element by
// element (characters or messages), a space before the divergence moved into the answers; as
// its loop leaves it when one is a prefix of the other (the last common element stays out).
// The index is Python's: -1 (a space moved back from a divergence at the very start) splits
// each sequence before its own last element (slice_at).
template <typename Seq>
std::ptrdiff_t implicit_prompt_end(const Seq& chosen, const Seq& rejected) {
  const std::size_t n = std::min(chosen.size(), rejected.size());
  if (n == 0) throw Error("'chosen' and 'rejected' must not be empty");
  for (std::size_t i = 0; i < n; ++i)
    if (!same(chosen[i], rejected[i])) {
      // Python's chosen[i - 1] reads the last element when i == 0.
      const auto& before = chosen[i == 0 ? chosen.size() - 1 : i - 1];
      if constexpr (std::is_same_v<Seq, std::string>) {
        if (before == ' ') return static_cast<std::ptrdiff_t>(i) - 1;
      }
      return static_cast<std::ptrdiff_t>(i);
    }
  return static_cast<std::ptrdiff_t>(n) - 1;
}

// Where Python's x[:k] ends and x[k:] begins in a sequence of `size` elements.
std::size_t slice_at(std::ptrdiff_t k, std::size_t size) {
  return k < 0 ? size - std::min(size, static_cast<std::size_t>(-k))
               : std::min(size, static_cast<std::size_t>(k));
}

void extract_prompt(Part& prompt, Part& chosen, Part& rejected) {
  if (conversational(chosen) != conversational(rejected))
    throw Error("'chosen' and 'rejected' must both be strings or both lists of messages");
  if (conversational(chosen)) {
    auto& c = std::get<Messages>(chosen);
    auto& r = std::get<Messages>(rejected);
    const std::ptrdiff_t end = implicit_prompt_end(c, r);
    const auto at_c = static_cast<std::ptrdiff_t>(slice_at(end, c.size()));
    prompt = Messages(c.begin(), c.begin() + at_c);
    c.erase(c.begin(), c.begin() + at_c);
    r.erase(r.begin(), r.begin() + static_cast<std::ptrdiff_t>(slice_at(end, r.size())));
  } else {
    auto& c = std::get<std::string>(chosen);
    auto& r = std::get<std::string>(rejected);
    const std::ptrdiff_t end = implicit_prompt_end(c, r);
    prompt = c.substr(0, slice_at(end, c.size()));
    c.erase(0, slice_at(end, c.size()));
    r.erase(0, slice_at(end, r.size()));
  }
}

std::size_t common_prefix(const Tokens& a, const Tokens& b) {
  std::size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n])
    ++n;
  return n;
}

Messages joined(const Messages& a, const Messages& b) {
  Messages out = a;
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

// One sequence of a pair: its tokens and where its answer starts.
struct Sequence {
  Tokens ids;
  std::size_t answer = 0;
};

// DPO (DT:1036-1142, DT:146-207): joint tokenisation split at the common token prefix.
std::pair<Sequence, Sequence> dpo_sequences(const Part& prompt, Part chosen, Part rejected,
                                            const models::Tokenizer& tok,
                                            const models::ChatTemplate& tmpl) {
  Tokens p, pc, pr;
  if (conversational(prompt)) {
    const Messages& m = std::get<Messages>(prompt);
    p = models::render_chat(tok, tmpl, m, /*add_generation_prompt=*/true).ids;
    pc = models::render_chat(tok, tmpl, joined(m, std::get<Messages>(chosen))).ids;
    pr = models::render_chat(tok, tmpl, joined(m, std::get<Messages>(rejected))).ids;
  } else {
    // The EOS text ends a string answer that does not end with it already (DT:1056-1069).
    if (const auto eos = tok.eos_id())
      if (const auto text = tok.id_to_token(*eos))
        for (Part* a : {&chosen, &rejected}) {
          std::string& s = std::get<std::string>(*a);
          if (!s.ends_with(*text)) s += *text;
        }
    const std::string& s = std::get<std::string>(prompt);
    p = tok.encode(s, /*add_special_tokens=*/true);
    pc = tok.encode(s + std::get<std::string>(chosen), true);
    pr = tok.encode(s + std::get<std::string>(rejected), true);
  }
  const std::size_t n = std::min(common_prefix(p, pc), common_prefix(p, pr));
  return {Sequence{std::move(pc), n}, Sequence{std::move(pr), n}};
}

// The longest common start of two strings, in whole UTF-8 characters (Python compares
// characters).
std::size_t common_text_prefix(const std::string& a, const std::string& b) {
  std::size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n])
    ++n;
  while (n > 0 && n < a.size() && (static_cast<unsigned char>(a[n]) & 0xC0) == 0x80)
    --n;
  return n;
}

// ORPO and CPO (DU:167-300, OT:409-603, EU:685-720): text first, each answer tokenised after its
// prompt, BOS and EOS added where missing.
std::pair<Sequence, Sequence> legacy_sequences(const Part& prompt_part, const Part& chosen_part,
                                               const Part& rejected_part,
                                               const models::Tokenizer& tok,
                                               const models::ChatTemplate& tmpl) {
  std::string prompt, chosen, rejected;
  if (conversational(prompt_part)) {
    const Messages& m = std::get<Messages>(prompt_part);
    if (m.empty() || m.back().role != "user")
      throw Error("the prompt must end with a user message");
    prompt = models::render_chat(tok, tmpl, m, /*add_generation_prompt=*/true).text;
    const std::string pc =
        models::render_chat(tok, tmpl, joined(m, std::get<Messages>(chosen_part))).text;
    const std::string pr =
        models::render_chat(tok, tmpl, joined(m, std::get<Messages>(rejected_part))).text;
    prompt.resize(common_text_prefix(prompt, pc));
    prompt.resize(common_text_prefix(prompt, pr));
    chosen = pc.substr(prompt.size());
    rejected = pr.substr(prompt.size());
  } else {
    prompt = std::get<std::string>(prompt_part);
    chosen = std::get<std::string>(chosen_part);
    rejected = std::get<std::string>(rejected_part);
  }
  const Tokens p = tok.encode(prompt);
  auto answer = [&](const std::string& a) {
    Sequence s{tok.encode(prompt + a), p.size()};
    // A token merged across the boundary goes to the answer (build_tokenized_answer).
    if (s.answer > s.ids.size() || !std::equal(p.begin(), p.end(), s.ids.begin()))
      s.answer = p.empty() ? 0 : p.size() - 1;
    s.answer = std::min(s.answer, s.ids.size());
    return s;
  };
  Sequence c = answer(chosen), r = answer(rejected);
  std::size_t differ = c.answer > r.answer ? c.answer - r.answer : r.answer - c.answer;
  for (std::size_t i = 0; i < std::min(c.answer, r.answer); ++i)
    differ += c.ids[i] != r.ids[i];
  if (differ > 1)
    throw Error("the prompt tokenises differently before the chosen and the rejected answer");
  const auto bos = tok.bos_id();
  const auto eos = tok.eos_id();
  if (!eos) throw Error("the tokenizer has no EOS token, which ORPO and SimPO end answers with");
  for (Sequence* s : {&c, &r}) {
    if (bos && (s->answer == 0 || s->ids[0] != *bos)) {
      s->ids.insert(s->ids.begin(), *bos);
      ++s->answer;
    }
    if (s->ids.size() == s->answer || s->ids.back() != *eos) s->ids.push_back(*eos);
  }
  return {std::move(c), std::move(r)};
}

std::string prompt_preview(const Part& p) {
  if (!conversational(p)) return std::get<std::string>(p);
  const Messages& m = std::get<Messages>(p);
  for (auto it = m.rbegin(); it != m.rend(); ++it)
    if (it->role == "user") return it->content;
  return "";
}

}  // namespace

bool is_preference_pair(const json& j) {
  return j.is_object() && j.contains("chosen") && j.contains("rejected");
}

Example preference_example(json& j, const models::Tokenizer& tok, const models::ChatTemplate& tmpl,
                           Objective objective, std::int64_t max_length, PairCounts& counts,
                           std::string* prompt_out) {
  RONDO_ASSERT(objective != Objective::kSft && max_length > 0);
  Part chosen = read_part(j, "chosen"), rejected = read_part(j, "rejected");
  if (conversational(chosen) != conversational(rejected))
    throw Error("'chosen' and 'rejected' must both be strings or both lists of messages");
  Part prompt;
  // A prompt of the other kind than the answers is not theirs (DU:635-658): extracted as when
  // there is none.
  const bool given = j.contains("prompt") && !j["prompt"].is_null();
  if (given) prompt = read_part(j, "prompt");
  if (!given || conversational(prompt) != conversational(chosen))
    extract_prompt(prompt, chosen, rejected);
  if (prompt_out) *prompt_out = prompt_preview(prompt);

  const auto limit = static_cast<std::size_t>(max_length);
  auto [c, r] = objective == Objective::kDpo
                    ? dpo_sequences(prompt, chosen, rejected, tok, tmpl)
                    : legacy_sequences(prompt, chosen, rejected, tok, tmpl);
  bool cut = false;
  if (objective == Objective::kDpo) {
    // keep_start: a prompt that fills max_length drops the pair (DT:1134-1140); each sequence
    // keeps its first max_length tokens.
    if (c.answer >= limit) {
      ++counts.dropped;
      return {};
    }
  } else {
    // The answer cut to what max_length leaves after its prompt (OT:532-543).
    if (c.answer >= limit || r.answer >= limit) {
      ++counts.dropped;
      return {};
    }
  }
  for (Sequence* s : {&c, &r})
    if (s->ids.size() > limit) {
      s->ids.resize(limit);
      cut = true;
    }
  if (cut) ++counts.truncated;

  Example e;
  e.ids = c.ids;
  e.ids.insert(e.ids.end(), r.ids.begin(), r.ids.end());
  e.second = static_cast<std::int32_t>(c.ids.size());
  e.loss_mask.assign(e.ids.size(), 0);
  for (std::size_t i = c.answer; i < c.ids.size(); ++i)
    e.loss_mask[i] |= kAnswerToken;
  for (std::size_t i = r.answer; i < r.ids.size(); ++i)
    e.loss_mask[c.ids.size() + i] |= kAnswerToken;
  if (objective == Objective::kOrpo)
    for (std::size_t i = 0; i < c.ids.size(); ++i)
      e.loss_mask[i] |= kNllToken;
  else if (objective == Objective::kSimpo)
    for (std::size_t i = c.answer; i < c.ids.size(); ++i)
      e.loss_mask[i] |= kNllToken;
  return e;
}

}  // namespace rondo::engine
