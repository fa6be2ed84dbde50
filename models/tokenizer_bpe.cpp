// The BPE model (tokenizer_bpe.h): a word's tokens, merged by rank as `tokenizers`' Word::merge_all
// does, with a cache of recent words; building the merge table. Touches only its own tables and
// cache. Used by the tokenizer's pipeline and its builders (tokenizer.json, TokenizerSpec).
#include "models/tokenizer_bpe.h"

#include <cstdio>
#include <nlohmann/json.hpp>
#include <queue>

#include "kernels/error.h"
#include "models/unicode.h"

namespace rondo::models {

using nlohmann::json;

std::vector<BpeModel::Tok> BpeModel::tokenize(const std::string& w) const {
  std::vector<Tok> out;
  if (w.empty()) return out;
  if (ignore_merges) {
    auto it = vocab.find(w);
    if (it != vocab.end()) return {{it->second, 0, static_cast<std::uint32_t>(w.size())}};
  }
  {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    auto it = cache_.find(w);
    if (it != cache_.end()) return it->second;
  }
  out = merge_word(w);
  if (w.size() < 256) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() >= 10000) cache_.clear();
    cache_.emplace(w, out);
  }
  return out;
}

std::vector<BpeModel::Tok> BpeModel::merge_word(const std::string& w) const {
  std::vector<Symbol> sym;
  auto add = [&](std::int32_t id, std::uint32_t b, std::uint32_t e) {
    const auto n = static_cast<std::int64_t>(sym.size());
    sym.push_back({id, n - 1, n + 1, b, e});
  };
  Tok unk{-1, 0, 0};  // pending unknown (id -1 = none), fused or not
  for (std::size_t i = 0; i < w.size();) {
    const std::size_t start = i;
    unicode::next(w, i);
    std::string s = w.substr(start, i - start);
    if (start != 0 && !continuing_subword_prefix.empty()) s = continuing_subword_prefix + s;
    if (i == w.size() && !end_of_word_suffix.empty()) s += end_of_word_suffix;
    const auto b = static_cast<std::uint32_t>(start), e = static_cast<std::uint32_t>(i);
    auto it = vocab.find(s);
    if (it != vocab.end()) {
      if (unk.id >= 0) add(unk.id, unk.begin, unk.end), unk.id = -1;
      add(it->second, b, e);
      continue;
    }
    if (byte_fallback) {
      bool all = true;
      for (unsigned char c : s)
        all = all && byte_ids[c] >= 0;
      if (all) {
        // As `tokenizers`: byte tokens do not flush a pending unknown.
        for (unsigned char c : s)
          add(byte_ids[c], b, e);
        continue;
      }
    }
    if (unk_id >= 0) {
      if (unk.id >= 0 && fuse_unk) {
        unk.end = e;
      } else {
        if (unk.id >= 0) add(unk.id, unk.begin, unk.end);
        unk = Tok{unk_id, b, e};
      }
    }
  }
  if (unk.id >= 0) add(unk.id, unk.begin, unk.end);
  if (!sym.empty()) sym.back().next = -1;

  // Merge by (rank, position), as `tokenizers`' Word::merge_all.
  struct Merge {
    std::size_t pos;
    std::int32_t rank, id;
    bool operator<(const Merge& o) const {  // priority_queue pops the largest: invert
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Merge> queue;
  for (std::size_t k = 0; k + 1 < sym.size(); ++k) {
    auto it = merges.find(key(sym[k].id, sym[k + 1].id));
    if (it != merges.end()) queue.push({k, it->second.first, it->second.second});
  }
  while (!queue.empty()) {
    const Merge top = queue.top();
    queue.pop();
    Symbol& cur = sym[top.pos];
    if (cur.end == cur.begin || cur.next < 0) continue;
    const auto next_pos = static_cast<std::size_t>(cur.next);
    const Symbol right = sym[next_pos];
    auto it = merges.find(key(cur.id, right.id));
    if (it == merges.end() || it->second.second != top.id) continue;
    cur.id = top.id;
    cur.end = right.end;
    cur.next = right.next;
    sym[next_pos].end = sym[next_pos].begin;  // removed
    if (right.next >= 0 && static_cast<std::size_t>(right.next) < sym.size())
      sym[static_cast<std::size_t>(right.next)].prev = static_cast<std::int64_t>(top.pos);
    if (cur.prev >= 0) {
      const auto prev = static_cast<std::size_t>(cur.prev);
      auto m = merges.find(key(sym[prev].id, cur.id));
      if (m != merges.end()) queue.push({prev, m->second.first, m->second.second});
    }
    if (cur.next >= 0 && static_cast<std::size_t>(cur.next) < sym.size()) {
      auto m = merges.find(key(cur.id, sym[static_cast<std::size_t>(cur.next)].id));
      if (m != merges.end()) queue.push({top.pos, m->second.first, m->second.second});
    }
  }
  std::vector<Tok> out;
  for (const Symbol& s : sym)
    if (s.end != s.begin) out.push_back({s.id, s.begin, s.end});
  return out;
}

void BpeModel::add_merge(const std::string& a, const std::string& b, std::int32_t rank,
                         const std::string& source, const std::string& where) {
  auto fail = [&](const std::string& msg) { throw Error(source + ": " + where + ": " + msg); };
  auto ia = vocab.find(a), ib = vocab.find(b);
  if (ia == vocab.end() || ib == vocab.end())
    fail("merge of " + json(a).dump() + " and " + json(b).dump() +
         ": a part is not in the vocabulary");
  std::string joined = a;
  if (!continuing_subword_prefix.empty() &&
      b.compare(0, continuing_subword_prefix.size(), continuing_subword_prefix) == 0)
    joined += b.substr(continuing_subword_prefix.size());
  else
    joined += b;
  auto ij = vocab.find(joined);
  if (ij == vocab.end()) fail("merge result " + json(joined).dump() + " is not in the vocabulary");
  merges.emplace(key(ia->second, ib->second), std::make_pair(rank, ij->second));
}

void BpeModel::fill_byte_ids() {
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    auto it = vocab.find(name);
    byte_ids[static_cast<std::size_t>(b)] = it == vocab.end() ? -1 : it->second;
  }
}

}  // namespace rondo::models
