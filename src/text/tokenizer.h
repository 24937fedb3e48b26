// Text <-> token ids with a Hugging Face tokenizer.json (the file `tokenizers` writes and reads), for
// `trainer sample` and the training-time samples. The data itself is tokenized in Python by the
// `tokenizers` library (scripts/prepare_data.py); this is the same encoding in C++ for prompts.
//
// Supported: byte-level BPE, the family of GPT-2, LLaMA 3 and what prepare_data.py trains:
//   normalizer     null or NFC (ICU)
//   pre_tokenizer  ByteLevel (its regex when use_regex), Split {Regex, behavior Isolated}, or a
//                  Sequence of those; the regexes run on ICU (same Unicode classes as Oniguruma's)
//   model          BPE over the byte-level alphabet (merges by rank, ignore_merges), no byte_fallback,
//                  no continuing_subword_prefix / end_of_word_suffix, no dropout
//   decoder        ByteLevel (or null)
//   added_tokens   matched verbatim before pre-tokenization (no lstrip / rstrip / single_word)
// The post_processor is not applied: encode() is tokenizers' encode(text, add_special_tokens=False),
// so a prompt gets no BOS; the model sees exactly the ids of the text. Anything else (SentencePiece
// style Metaspace + byte_fallback, WordPiece, Unigram) is refused with a TokenizerError naming what
// is unsupported. The vocabulary size is readable for every kind (vocab_size_of_file).
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "errors.h"

namespace sl::text {

// A tokenizer.json that cannot be used: unreadable or malformed (exit 3), or of an unsupported kind (exit 2).
struct TokenizerError : Error {
  using Error::Error;
};

class Tokenizer {
 public:
  // Reads and checks the file; throws TokenizerError.
  static Tokenizer from_file(const std::filesystem::path& path);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  std::vector<int64_t> encode(std::string_view text) const;
  // The bytes the ids stand for, as text; a cut UTF-8 sequence becomes U+FFFD (as tokenizers' decode).
  std::string decode(const std::vector<int64_t>& ids) const;
  // The raw bytes of one id ("" for an id outside the vocabulary).
  std::string token_bytes(int64_t id) const;
  int64_t vocab_size() const;  // the largest id + 1, added tokens included
  std::optional<int64_t> id_of(const std::string& token) const;  // a vocabulary entry or added token, verbatim
  // The end-of-text id: the eos_token of the tokenizer_config.json beside the file, else the eot of
  // prepare_data.py's data.json beside it, else the first of <|endoftext|>, <|end_of_text|>, </s>, <eos>
  // that exists.
  std::optional<int64_t> end_of_text() const;
  const std::filesystem::path& path() const { return path_; }

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl, std::filesystem::path path);
  std::unique_ptr<Impl> impl_;
  std::filesystem::path path_;
};

// Text <-> ids for a model: its tokenizer.json, or raw bytes for a 256-token model trained on bytes
// without one (data.source: text, scripts/txt_to_bin.py). Copyable.
class TextCodec {
 public:
  // path "" = bytes, allowed only for a model of 256 tokens (ConfigError otherwise). A tokenizer's
  // vocabulary must match model_vocab (check_vocab_match). Throws ConfigError / TokenizerError.
  static TextCodec open(const std::filesystem::path& path, int64_t model_vocab);
  std::vector<int64_t> encode(const std::string& text) const;
  std::string decode(const std::vector<int64_t>& ids) const;
  std::optional<int64_t> end_of_text() const;
  std::string name() const;  // the tokenizer.json, or "bytes"
  // A prompt's ids; "" = the end-of-text token alone (ConfigError when there is none: give a prompt).
  std::vector<int64_t> prompt(const std::string& text) const;

 private:
  std::shared_ptr<const Tokenizer> tokenizer_;  // null: bytes
};

// Throws ConfigError (exit 2) naming both numbers unless the model's vocabulary is the tokenizer's, or
// the tokenizer's padded up to the next multiple of 64 or 128 (llm.c's 50257 -> 50304: the extra rows are
// never a target). `where` names the tokenizer file.
void check_vocab_match(int64_t tokenizer_vocab, int64_t model_vocab, const std::string& where);

// `bytes` as UTF-8 text; each ill-formed subsequence becomes U+FFFD (what tokenizers' decode does).
std::string utf8_lossy(std::string_view bytes);

// What a training run needs to know of any tokenizer.json (BPE, WordPiece, Unigram, ...), supported
// for encoding or not. Throws TokenizerError (exit 3) for an unreadable file.
struct TokenizerFileInfo {
  int64_t vocab_size = 0;          // the largest id + 1 over its model's vocabulary and its added tokens
  std::string end_of_text;         // the end-of-text token ("" = none), as Tokenizer::end_of_text picks it
  std::optional<int64_t> end_of_text_id;
};
TokenizerFileInfo inspect_tokenizer_file(const std::filesystem::path& path);

// Makes `dir` loadable by transformers' AutoTokenizer: tokenizer.json (a byte copy of tokenizer_json)
// and tokenizer_config.json (PreTrainedTokenizerFast, the end-of-text token as eos and bos,
// model_max_length). A copy of a file into its own directory rewrites only tokenizer_config.json. Each file atomic;
// IoError (exit 7) on a failed write, TokenizerError (3) for an unreadable source.
void write_hf_tokenizer(const std::filesystem::path& dir, const std::filesystem::path& tokenizer_json,
                        int64_t model_max_length);

}  // namespace sl::text
