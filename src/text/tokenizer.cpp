// Byte-level BPE from a tokenizer.json: added-token split, normalizer, pre-tokenizer regexes (ICU), the
// merge loop, and decoding. Facts of the format (the byte-to-character table, the GPT-2 split pattern,
// merges by rank) are from the `tokenizers` documentation and GPT-2's encoder description.
#include "text/tokenizer.h"

#include <sstream>

#include <algorithm>
#include <array>
#include <fstream>
#include <limits>
#include <map>
#include <queue>
#include <unordered_map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <unicode/normalizer2.h>
#include <unicode/regex.h>
#include <unicode/unistr.h>

#include "log/files.h"

namespace sl::text {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

// The split pattern of tokenizers' ByteLevel pre-tokenizer with use_regex (GPT-2's).
constexpr const char* kByteLevelPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

[[noreturn]] void bad_file(const fs::path& path, const std::string& what) {
  throw TokenizerError(kExitData, fmt::format("{}: {}; give the tokenizer.json that came with the model or that "
                                              "scripts/prepare_data.py wrote", path.string(), what));
}

[[noreturn]] void unsupported(const fs::path& path, const std::string& what) {
  throw TokenizerError(kExitConfig,
                       fmt::format("{}: {} is not supported; this trainer encodes byte-level BPE tokenizers "
                                   "(GPT-2, LLaMA 3, scripts/prepare_data.py's) (src/text/tokenizer.h)",
                                   path.string(), what));
}

Json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) bad_file(path, "cannot be read");
  try {
    return Json::parse(in);
  } catch (const Json::exception& e) {
    bad_file(path, fmt::format("not valid JSON ({})", e.what()));
  }
}

// Byte-level BPE writes every byte as one printable character: the printable Latin-1 bytes ('!'..'~',
// '¡'..'¬', '®'..'ÿ') as themselves, the other 68 as U+0100, U+0101, ... in byte order. This is the
// inverse: character -> byte (-1 for a character outside the alphabet).
const std::unordered_map<uint32_t, int>& byte_of_char() {
  static const auto table = [] {
    std::unordered_map<uint32_t, int> t;
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[printable ? static_cast<uint32_t>(b) : next++] = b;
    }
    return t;
  }();
  return table;
}

// A vocabulary entry in the byte-level alphabet -> the raw bytes it stands for; nullopt when a character
// is outside the alphabet (an added token's text stored in the vocabulary, e.g. "<|endoftext|>" is
// inside it, but a non-byte-level entry is not).
std::optional<std::string> alphabet_to_bytes(const std::string& s) {
  const icu::UnicodeString u = icu::UnicodeString::fromUTF8(s);
  std::string out;
  for (int32_t i = 0; i < u.length();) {
    const UChar32 cp = u.char32At(i);
    const auto it = byte_of_char().find(static_cast<uint32_t>(cp));
    if (it == byte_of_char().end()) return std::nullopt;
    out += static_cast<char>(it->second);
    i += U16_LENGTH(cp);
  }
  return out;
}

// A merge's lookup key: a's length (4 bytes), a, b.
std::string merge_key(const std::string& a, const std::string& b) {
  const auto size = static_cast<uint32_t>(a.size());
  std::string key(reinterpret_cast<const char*>(&size), sizeof size);
  key.reserve(sizeof size + a.size() + b.size());
  return key.append(a).append(b);
}

// End-of-text tokens by family (GPT-2 and prepare_data.py, LLaMA 3, LLaMA 2 / SentencePiece, Gemma), first found wins.
constexpr const char* kEndOfTextTokens[] = {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"};

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) bad_file(path, "cannot be read");
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

// The end-of-text token's candidates, best first: the eos_token of the tokenizer_config.json beside the
// file (a checkpoint's, or the one prepare_data.py and record_tokenizer write), the eot of prepare_data.py's
// data.json beside it, then the usual names.
std::vector<std::string> end_of_text_candidates(const fs::path& tokenizer_json) {
  std::vector<std::string> out;
  auto read_key = [&](const char* file, const char* key) {
    std::error_code ec;
    const fs::path p = tokenizer_json.parent_path() / file;
    if (!fs::is_regular_file(p, ec)) return;
    std::ifstream in(p);
    const Json j = Json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains(key)) return;
    const Json& v = j[key];
    if (v.is_string()) out.push_back(v.get<std::string>());
    else if (v.is_object() && v.value("content", Json()).is_string()) out.push_back(v["content"].get<std::string>());
  };
  read_key("tokenizer_config.json", "eos_token");
  read_key("data.json", "eot");
  out.insert(out.end(), std::begin(kEndOfTextTokens), std::end(kEndOfTextTokens));
  return out;
}

struct AddedToken {
  std::string content;
  int64_t id;
};

}  // namespace

struct Tokenizer::Impl {
  std::unordered_map<std::string, int64_t> vocab;       // raw bytes -> id
  std::vector<std::string> id_bytes;                    // id -> raw bytes (added tokens: their text)
  std::unordered_map<std::string, int64_t> merge_rank;  // merge_key(a, b) -> rank
  std::vector<AddedToken> added;                        // longest first
  std::unordered_map<std::string, int64_t> by_text;     // vocabulary entries and added tokens, verbatim
  std::vector<std::unique_ptr<icu::RegexPattern>> splits;  // applied in order, each Isolated
  bool nfc = false;
  bool add_prefix_space = false;
  bool ignore_merges = false;
  std::optional<int64_t> end_of_text;

  void read_normalizer(const fs::path& path, const Json& n);
  void read_pre_tokenizer(const fs::path& path, const Json& p);
  void add_split(const fs::path& path, const std::string& pattern);
  void read_model(const fs::path& path, const Json& m);
  void read_added(const fs::path& path, const Json& a);

  std::vector<std::string> pre_tokenize(const std::string& segment) const;
  void bpe(const std::string& piece, std::vector<int64_t>& out) const;
  void encode_segment(std::string segment, std::vector<int64_t>& out) const;
};

void Tokenizer::Impl::read_normalizer(const fs::path& path, const Json& n) {
  if (n.is_null()) return;
  const std::string type = n.value("type", "");
  if (type == "NFC") nfc = true;
  else unsupported(path, fmt::format("normalizer \"{}\"", type));
}

void Tokenizer::Impl::add_split(const fs::path& path, const std::string& pattern) {
  UErrorCode status = U_ZERO_ERROR;
  UParseError where;
  std::unique_ptr<icu::RegexPattern> p(
      icu::RegexPattern::compile(icu::UnicodeString::fromUTF8(pattern), 0, where, status));
  if (U_FAILURE(status))
    bad_file(path, fmt::format("the split pattern {} does not compile ({})", pattern, u_errorName(status)));
  splits.push_back(std::move(p));
}

void Tokenizer::Impl::read_pre_tokenizer(const fs::path& path, const Json& p) {
  if (p.is_null()) return;
  const std::string type = p.value("type", "");
  if (type == "Sequence") {
    for (const auto& q : p.at("pretokenizers")) read_pre_tokenizer(path, q);
  } else if (type == "ByteLevel") {
    add_prefix_space = add_prefix_space || p.value("add_prefix_space", false);
    if (p.value("use_regex", true)) add_split(path, kByteLevelPattern);
  } else if (type == "Split") {
    const Json& pattern = p.at("pattern");
    if (!pattern.contains("Regex")) unsupported(path, "a Split pre-tokenizer on a plain string");
    if (p.value("behavior", "") != "Isolated" || p.value("invert", false))
      unsupported(path, fmt::format("Split behavior \"{}\"{}", p.value("behavior", ""),
                                    p.value("invert", false) ? " inverted" : ""));
    add_split(path, pattern.at("Regex").get<std::string>());
  } else {
    unsupported(path, fmt::format("pre_tokenizer \"{}\"", type));
  }
}

void Tokenizer::Impl::read_model(const fs::path& path, const Json& m) {
  const std::string type = m.value("type", "");
  if (type != "BPE") unsupported(path, fmt::format("model \"{}\"", type));
  if (m.value("byte_fallback", false)) unsupported(path, "BPE byte_fallback (SentencePiece style)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (m.contains(key) && m[key].is_string() && !m[key].get<std::string>().empty())
      unsupported(path, fmt::format("BPE {}", key));
  if (m.contains("dropout") && !m["dropout"].is_null()) unsupported(path, "BPE dropout");
  ignore_merges = m.value("ignore_merges", false);
  for (const auto& [text, id_json] : m.at("vocab").items()) {
    const int64_t id = id_json.get<int64_t>();
    if (id < 0) bad_file(path, fmt::format("vocabulary entry {} has a negative id", text));
    if (static_cast<size_t>(id) >= id_bytes.size()) id_bytes.resize(static_cast<size_t>(id) + 1);
    const auto bytes = alphabet_to_bytes(text);
    id_bytes[static_cast<size_t>(id)] = bytes ? *bytes : text;
    if (bytes) vocab.emplace(*bytes, id);
    by_text.emplace(text, id);
  }
  int64_t rank = 0;
  for (const auto& merge : m.at("merges")) {
    std::string a, b;
    if (merge.is_array()) {
      a = merge.at(0).get<std::string>();
      b = merge.at(1).get<std::string>();
    } else {
      const std::string s = merge.get<std::string>();
      const auto space = s.find(' ');
      if (space == std::string::npos) bad_file(path, fmt::format("merge \"{}\" is not two symbols", s));
      a = s.substr(0, space);
      b = s.substr(space + 1);
    }
    const auto ba = alphabet_to_bytes(a), bb = alphabet_to_bytes(b);
    if (!ba || !bb) unsupported(path, fmt::format("merge \"{} {}\" outside the byte-level alphabet", a, b));
    merge_rank.emplace(merge_key(*ba, *bb), rank++);
  }
}

void Tokenizer::Impl::read_added(const fs::path& path, const Json& a) {
  if (a.is_null()) return;
  for (const auto& t : a) {
    const std::string content = t.at("content").get<std::string>();
    if (t.value("lstrip", false) || t.value("rstrip", false) || t.value("single_word", false))
      unsupported(path, fmt::format("added token {} with lstrip / rstrip / single_word", content));
    const int64_t id = t.at("id").get<int64_t>();
    if (id < 0) bad_file(path, fmt::format("added token {} has a negative id", content));
    if (static_cast<size_t>(id) >= id_bytes.size()) id_bytes.resize(static_cast<size_t>(id) + 1);
    id_bytes[static_cast<size_t>(id)] = content;
    by_text[content] = id;
    if (!content.empty()) added.push_back({content, id});
  }
  std::stable_sort(added.begin(), added.end(),
                   [](const auto& x, const auto& y) { return x.content.size() > y.content.size(); });
}

std::vector<std::string> Tokenizer::Impl::pre_tokenize(const std::string& segment) const {
  std::vector<std::string> pieces{segment};
  for (const auto& pattern : splits) {
    std::vector<std::string> next;
    for (const auto& piece : pieces) {
      const icu::UnicodeString u = icu::UnicodeString::fromUTF8(piece);
      UErrorCode status = U_ZERO_ERROR;
      std::unique_ptr<icu::RegexMatcher> m(pattern->matcher(u, status));
      int32_t done = 0;
      auto take = [&](int32_t begin, int32_t end) {
        if (end <= begin) return;
        std::string s;
        u.tempSubStringBetween(begin, end).toUTF8String(s);
        next.push_back(std::move(s));
      };
      while (U_SUCCESS(status) && m->find(status)) {
        const int32_t begin = m->start(status), end = m->end(status);
        if (end == begin) continue;  // an empty match splits nothing
        take(done, begin);           // Isolated: the text between matches is a piece of its own
        take(begin, end);
        done = end;
      }
      take(done, u.length());
    }
    pieces = std::move(next);
  }
  return pieces;
}

// Merges the piece's bytes by rank, lowest first (the leftmost pair among equal ranks), until no adjacent
// pair has a merge; each symbol left is one id. Candidate pairs wait in a queue ordered by (rank,
// position); one whose symbols changed since it was queued is skipped (a symbol only grows, so equal
// sizes mean unchanged). O(n log n) in the piece's length, as tokenizers' own BPE.
void Tokenizer::Impl::bpe(const std::string& piece, std::vector<int64_t>& out) const {
  if (ignore_merges) {
    const auto whole = vocab.find(piece);
    if (whole != vocab.end()) {
      out.push_back(whole->second);
      return;
    }
  }
  const int n = static_cast<int>(piece.size());
  std::vector<std::string> sym(static_cast<size_t>(n));
  std::vector<int> next(static_cast<size_t>(n)), prev(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    sym[static_cast<size_t>(i)] = std::string(1, piece[static_cast<size_t>(i)]);
    next[static_cast<size_t>(i)] = i + 1 < n ? i + 1 : -1;
    prev[static_cast<size_t>(i)] = i - 1;
  }
  struct Candidate {
    int64_t rank;
    int left;
    size_t left_size, right_size;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  auto offer = [&](int i) {
    if (i < 0 || next[static_cast<size_t>(i)] < 0) return;
    const auto& a = sym[static_cast<size_t>(i)];
    const auto& b = sym[static_cast<size_t>(next[static_cast<size_t>(i)])];
    const auto it = merge_rank.find(merge_key(a, b));
    if (it != merge_rank.end()) queue.push({it->second, i, a.size(), b.size()});
  };
  for (int i = 0; i < n; ++i) offer(i);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    const auto i = static_cast<size_t>(c.left);
    const int j = next[i];
    if (sym[i].empty() || j < 0 || sym[i].size() != c.left_size || sym[static_cast<size_t>(j)].size() != c.right_size)
      continue;  // stale: a neighbour merged since
    sym[i] += sym[static_cast<size_t>(j)];
    sym[static_cast<size_t>(j)].clear();
    next[i] = next[static_cast<size_t>(j)];
    if (next[i] >= 0) prev[static_cast<size_t>(next[i])] = c.left;
    offer(prev[i]);
    offer(c.left);
  }
  for (int i = 0; i >= 0 && n > 0; i = next[static_cast<size_t>(i)]) {
    const auto it = vocab.find(sym[static_cast<size_t>(i)]);
    if (it == vocab.end())
      throw TokenizerError(kExitData, fmt::format("the tokenizer has no id for the bytes of \"{}\" (its byte-level "
                                                  "alphabet is incomplete)", sym[static_cast<size_t>(i)]));
    out.push_back(it->second);
  }
}

void Tokenizer::Impl::encode_segment(std::string segment, std::vector<int64_t>& out) const {
  if (segment.empty()) return;
  if (nfc) {
    UErrorCode status = U_ZERO_ERROR;
    const icu::Normalizer2* n = icu::Normalizer2::getNFCInstance(status);
    icu::UnicodeString normalized = n->normalize(icu::UnicodeString::fromUTF8(segment), status);
    segment.clear();
    normalized.toUTF8String(segment);
  }
  if (add_prefix_space && segment[0] != ' ') segment.insert(segment.begin(), ' ');
  for (const auto& piece : pre_tokenize(segment)) bpe(piece, out);
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl, fs::path path) : impl_(std::move(impl)), path_(std::move(path)) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

Tokenizer Tokenizer::from_file(const fs::path& path) {
  const Json j = read_json(path);
  auto impl = std::make_unique<Impl>();
  try {
    if (!j.contains("model")) bad_file(path, "no \"model\" section (not a tokenizers tokenizer.json)");
    impl->read_normalizer(path, j.value("normalizer", Json(nullptr)));
    impl->read_pre_tokenizer(path, j.value("pre_tokenizer", Json(nullptr)));
    impl->read_model(path, j.at("model"));
    impl->read_added(path, j.value("added_tokens", Json(nullptr)));
    const Json decoder = j.value("decoder", Json(nullptr));
    if (!decoder.is_null() && decoder.value("type", "") != "ByteLevel")
      unsupported(path, fmt::format("decoder \"{}\"", decoder.value("type", "")));
  } catch (const Json::exception& e) {
    bad_file(path, fmt::format("a key is missing or has the wrong type ({})", e.what()));
  }
  for (int b = 0; b < 256; ++b)
    if (!impl->vocab.count(std::string(1, static_cast<char>(b))))
      unsupported(path, fmt::format("a vocabulary without the byte {:#04x} (not byte-level)", b));
  for (const auto& t : end_of_text_candidates(path)) {
    const auto it = impl->by_text.find(t);
    if (it == impl->by_text.end()) continue;
    impl->end_of_text = it->second;
    break;
  }
  return Tokenizer(std::move(impl), path);
}

std::vector<int64_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int64_t> out;
  size_t done = 0, i = 0;
  while (i < text.size()) {
    const AddedToken* hit = nullptr;
    for (const auto& t : impl_->added)
      if (text.compare(i, t.content.size(), t.content) == 0) {
        hit = &t;
        break;
      }
    if (!hit) {
      ++i;
      continue;
    }
    impl_->encode_segment(std::string(text.substr(done, i - done)), out);
    out.push_back(hit->id);
    i += hit->content.size();
    done = i;
  }
  impl_->encode_segment(std::string(text.substr(done)), out);
  return out;
}

std::string Tokenizer::token_bytes(int64_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->id_bytes.size()) return {};
  return impl_->id_bytes[static_cast<size_t>(id)];
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string bytes;
  for (int64_t id : ids) bytes += token_bytes(id);
  return utf8_lossy(bytes);
}

std::string utf8_lossy(std::string_view bytes) {
  std::string text;  // ICU replaces each ill-formed subsequence with U+FFFD
  icu::UnicodeString::fromUTF8(icu::StringPiece(bytes.data(), static_cast<int32_t>(bytes.size()))).toUTF8String(text);
  return text;
}

TextCodec TextCodec::open(const fs::path& path, int64_t model_vocab) {
  TextCodec c;
  if (path.empty()) {
    if (model_vocab != 256)
      throw ConfigError(
          fmt::format("no tokenizer.json for a model of {} tokens (only a 256-token model is read as bytes); "
                      "give the tokenizer the data was made with (data.tokenizer, or sample --tokenizer)",
                      model_vocab));
    return c;
  }
  c.tokenizer_ = std::make_shared<const Tokenizer>(Tokenizer::from_file(path));
  check_vocab_match(c.tokenizer_->vocab_size(), model_vocab, path.string());
  return c;
}

std::vector<int64_t> TextCodec::encode(const std::string& text) const {
  if (tokenizer_) return tokenizer_->encode(text);
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
  return std::vector<int64_t>(bytes, bytes + text.size());
}

std::string TextCodec::decode(const std::vector<int64_t>& ids) const {
  if (tokenizer_) return tokenizer_->decode(ids);
  std::string bytes;
  for (int64_t id : ids) bytes += static_cast<char>(id);
  return utf8_lossy(bytes);
}

std::optional<int64_t> TextCodec::end_of_text() const { return tokenizer_ ? tokenizer_->end_of_text() : std::nullopt; }

std::string TextCodec::name() const { return tokenizer_ ? tokenizer_->path().string() : "bytes"; }

std::vector<int64_t> TextCodec::prompt(const std::string& text) const {
  if (!text.empty()) return encode(text);
  const auto eot = end_of_text();
  if (!eot)
    throw ConfigError(
        fmt::format("the tokenizer ({}) has no end-of-text token to start a sample from; give a prompt", name()));
  return {*eot};
}

void check_vocab_match(int64_t tokenizer_vocab, int64_t model_vocab, const std::string& where) {
  auto round_up = [&](int64_t m) { return (tokenizer_vocab + m - 1) / m * m; };
  if (model_vocab == tokenizer_vocab || model_vocab == round_up(64) || model_vocab == round_up(128)) return;
  throw ConfigError(
      fmt::format("{} has a vocabulary of {} tokens but model.vocab_size is {}; set model.vocab_size: {} "
                  "(or {} / {}, padded to a multiple of 64 / 128; model.vocab_multiple pads the model's tables "
                  "instead, keeping the "
                  "padding out of the loss), or use the tokenizer the data was made with",
                  where, tokenizer_vocab, model_vocab, tokenizer_vocab, round_up(64), round_up(128)));
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_bytes.size()); }

std::optional<int64_t> Tokenizer::id_of(const std::string& token) const {
  const auto it = impl_->by_text.find(token);
  if (it == impl_->by_text.end()) return std::nullopt;
  return it->second;
}

std::optional<int64_t> Tokenizer::end_of_text() const { return impl_->end_of_text; }

TokenizerFileInfo inspect_tokenizer_file(const fs::path& path) {
  const Json j = read_json(path);
  TokenizerFileInfo info;
  int64_t largest = -1;
  std::map<std::string, int64_t> by_text;  // vocabulary entries and added tokens
  try {
    const Json& vocab = j.at("model").at("vocab");
    if (vocab.is_object())
      for (const auto& [text, id] : vocab.items()) {
        largest = std::max(largest, id.get<int64_t>());
        by_text[text] = id.get<int64_t>();
      }
    else if (vocab.is_array())  // Unigram: [[piece, score], ...], ids by position
      largest = static_cast<int64_t>(vocab.size()) - 1;
    for (const auto& t : j.value("added_tokens", Json::array())) {
      largest = std::max(largest, t.at("id").get<int64_t>());
      by_text[t.at("content").get<std::string>()] = t.at("id").get<int64_t>();
    }
  } catch (const Json::exception& e) {
    bad_file(path, fmt::format("no model vocabulary ({})", e.what()));
  }
  if (largest < 0) bad_file(path, "an empty vocabulary");
  info.vocab_size = largest + 1;
  for (const auto& t : end_of_text_candidates(path))
    if (by_text.count(t)) {
      info.end_of_text = t;
      info.end_of_text_id = by_text[t];
      break;
    }
  return info;
}

void write_hf_tokenizer(const fs::path& dir, const fs::path& tokenizer_json, int64_t model_max_length) {
  const TokenizerFileInfo info = inspect_tokenizer_file(tokenizer_json);
  Json config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                 {"model_max_length", model_max_length},
                 {"clean_up_tokenization_spaces", false}};
  if (!info.end_of_text.empty()) config["eos_token"] = config["bos_token"] = info.end_of_text;
  std::error_code ec;
  if (!fs::equivalent(dir / "tokenizer.json", tokenizer_json, ec))
    log::write_file_atomic(dir / "tokenizer.json", read_bytes(tokenizer_json));
  log::write_file_atomic(dir / "tokenizer_config.json", config.dump(2) + "\n");
  log::fsync_dir(dir);
}

}  // namespace sl::text
