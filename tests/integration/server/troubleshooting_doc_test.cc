// docs/troubleshooting.md and the log lines it quotes cannot drift apart.
//
// For every log line or error an operator meets (table below), the test
// finds its format string in the source (adjacent string literals joined, as
// the compiler does), turns it into a pattern (each `{...}` field matches any
// text), and requires a line inside a code block of the named section of the
// doc to match it. Lines Ember prints with a pointer must end with
// "see docs/troubleshooting.md#<anchor>". And every such pointer anywhere in
// the sources names a heading that exists.
//
// Reads files only (EMBER_SOURCE_DIR); no process, no network.
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace ember::test {
namespace {

namespace fs = std::filesystem;

const fs::path kRoot = EMBER_SOURCE_DIR;
constexpr std::string_view kPointer = "see docs/troubleshooting.md#";

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  EXPECT_TRUE(in.good()) << "cannot read " << p;
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The string literals of a C++ source, adjacent ones joined and escapes
// undone. Comments and character literals are skipped; raw strings are not
// supported (the files read here have none).
std::vector<std::string> string_literals(const std::string& src) {
  std::vector<std::string> out;
  std::string current;
  bool joining = false;  // the last token was a string literal
  std::size_t i = 0;
  const std::size_t n = src.size();
  auto flush = [&] {
    if (joining) out.push_back(current);
    current.clear();
    joining = false;
  };
  while (i < n) {
    const char c = src[i];
    if (c == '/' && i + 1 < n && src[i + 1] == '/') {
      i = src.find('\n', i);
      if (i == std::string::npos) break;
      continue;
    }
    if (c == '/' && i + 1 < n && src[i + 1] == '*') {
      i = src.find("*/", i + 2);
      if (i == std::string::npos) break;
      i += 2;
      continue;
    }
    if (c == '\'') {
      // A character literal ('"', '\''); a digit separator (1'000) has a
      // digit before it.
      if (i > 0 && std::isalnum(static_cast<unsigned char>(src[i - 1]))) {
        ++i;
        continue;
      }
      ++i;
      while (i < n && src[i] != '\'') i += src[i] == '\\' ? 2 : 1;
      ++i;
      flush();
      continue;
    }
    if (c == '"') {
      ++i;
      while (i < n && src[i] != '"') {
        if (src[i] == '\\' && i + 1 < n) {
          const char e = src[i + 1];
          current += e == 'n' ? '\n' : e == 't' ? '\t' : e;
          i += 2;
        } else {
          current += src[i++];
        }
      }
      ++i;
      joining = true;
      continue;
    }
    if (!std::isspace(static_cast<unsigned char>(c))) flush();
    ++i;
  }
  flush();
  return out;
}

// A pattern matching what a {fmt} format string prints: literal text
// escaped, each replacement field `{...}` any non-empty text, `{{` and `}}`
// the braces themselves.
std::regex format_pattern(const std::string& fmt) {
  std::string re;
  for (std::size_t i = 0; i < fmt.size(); ++i) {
    const char c = fmt[i];
    if (c == '{' && i + 1 < fmt.size() && fmt[i + 1] == '{') {
      re += "\\{";
      ++i;
    } else if (c == '}' && i + 1 < fmt.size() && fmt[i + 1] == '}') {
      re += "\\}";
      ++i;
    } else if (c == '{') {
      i = fmt.find('}', i);
      re += ".+?";
    } else if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) {
      re += '\\';
      re += c;
    } else {
      re += c;
    }
  }
  return std::regex(re);
}

// GitHub's heading anchor: lowercase, spaces to '-', other punctuation dropped.
std::string slug(const std::string& heading) {
  std::string s;
  for (char c : heading) {
    if (std::isalnum(static_cast<unsigned char>(c))) {
      s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    } else if (c == ' ' || c == '-') {
      s += '-';
    }
  }
  return s;
}

struct Section {
  std::vector<std::string> code_lines;  // lines inside ``` blocks
};

// The doc's "## " sections by anchor.
std::map<std::string, Section> doc_sections() {
  std::map<std::string, Section> out;
  std::ifstream in(kRoot / "docs/troubleshooting.md");
  EXPECT_TRUE(in.good());
  std::string line;
  Section* current = nullptr;
  bool in_code = false;
  while (std::getline(in, line)) {
    if (line.rfind("```", 0) == 0) {
      in_code = !in_code;
      continue;
    }
    if (!in_code && line.rfind("## ", 0) == 0) {
      current = &out[slug(line.substr(3))];
      continue;
    }
    if (in_code && current != nullptr) current->code_lines.push_back(line);
  }
  return out;
}

struct Quoted {
  const char* anchor;   // section the line is quoted in
  const char* file;     // source holding the format string
  const char* locator;  // text only that format string contains
  bool has_pointer;     // the line ends with "see docs/troubleshooting.md#<anchor>"
};

// Lines of other owners' modules (transport, ring, membership) are checked
// for drift too, without a pointer (their owners may add one). The
// heartbeat-timeout reason and the transport = "auto" choice are not: their
// texts are being reworked in the transport module, and the doc quotes them
// as examples.
const Quoted kQuoted[] = {
    {"pool-exhaustion", "common/proto/runtime.cc", "receiving into heap memory instead", true},
    {"pool-exhaustion", "common/memory/page_pool.cc", "exhausted: no free", true},
    {"pool-exhaustion", "common/memory/page_pool.cc", "larger than the whole region", true},
    {"reordered-messages", "server/shard_core.cc", "arrived after that round closed", true},
    {"reordered-messages", "server/shard_core.cc", "steps past the open round", true},
    {"reordered-messages", "server/server.cc", "bad request from worker", false},
    {"out-of-step", "server/shard_core.cc", "does not follow the server", true},
    {"out-of-step", "server/server.cc", "bad request from worker", false},
    {"throughput-drops", "common/memory/page_pool.cc", "THP was granted", true},
    {"throughput-drops", "server/shard.cc", "cannot pin to CPU", true},
    {"throughput-drops", "common/transport/io_threads.cc", "could not be pinned to CPU", false},
    {"throughput-drops", "common/ring/mpsc_ring.h", "producer lanes are in use", false},
    // The pointer is appended unless the reason carries one: checked below.
    {"worker-loss", "server/server.cc", ") lost: {}{}", false},
    {"worker-loss", "server/server.cc", "this job has {} worker(s)", true},
    {"worker-loss", "server/server.cc", "back once its join succeeds", false},
    {"worker-loss", "server/server.cc", "is back (rejoining)", false},
    {"worker-loss", "server/server.cc", "disconnected: this server closed the connection", false},
    {"worker-loss", "worker/worker.cc", "request(s) failed", false},
    {"worker-loss", "server/membership.cc", "lost and not back within worker_timeout", false},
    {"worker-loss", "server/membership.cc", "which was lost (on_worker_loss", false},
    {"worker-loss", "server/membership.cc", "to reconnect) and was not back within", false},
    {"worker-loss", "server/membership.cc", "to reconnect) (on_worker_loss", false},
    {"training-diverged", "examples/fashion_mnist/trainer.cc", "training diverged", false},
};

TEST(TroubleshootingDoc, QuotesEveryLogLineAsEmberPrintsIt) {
  const auto sections = doc_sections();
  for (const Quoted& q : kQuoted) {
    SCOPED_TRACE(std::string(q.file) + ": " + q.locator);
    const auto literals = string_literals(slurp(kRoot / q.file));
    std::vector<std::string> found;
    for (const auto& l : literals) {
      if (l.find(q.locator) != std::string::npos) found.push_back(l);
    }
    ASSERT_EQ(found.size(), 1u) << "the locator must pick exactly one format string";
    const std::string& fmt = found[0];
    if (q.has_pointer) {
      const std::string tail = std::string(kPointer) + q.anchor;
      EXPECT_TRUE(fmt.size() >= tail.size() && fmt.compare(fmt.size() - tail.size(), tail.size(), tail) == 0)
          << "the line must end with \"" << tail << "\": " << fmt;
    }
    auto it = sections.find(q.anchor);
    ASSERT_TRUE(it != sections.end()) << "no section '## ...' with anchor #" << q.anchor;
    const std::regex re = format_pattern(fmt);
    bool quoted = false;
    for (const auto& line : it->second.code_lines) quoted = quoted || std::regex_search(line, re);
    EXPECT_TRUE(quoted) << "#" << q.anchor << " quotes no line matching the format string\n  " << fmt;
  }
}

// The lost-worker and lost-connection lines append the pointer as a
// separate literal (only when the transport's reason has none).
TEST(TroubleshootingDoc, WorkerLostLinesPointToWorkerLoss) {
  for (const char* file : {"server/server.cc", "worker/worker.cc"}) {
    bool found = false;
    for (const auto& l : string_literals(slurp(kRoot / file))) {
      found = found || l == "; see docs/troubleshooting.md#worker-loss";
    }
    EXPECT_TRUE(found) << file << " no longer appends the #worker-loss pointer";
  }
}

TEST(TroubleshootingDoc, EveryPointerInTheSourcesNamesAHeading) {
  const auto sections = doc_sections();
  std::size_t pointers = 0;
  for (const char* dir : {"common", "server", "worker", "tools", "capi"}) {
    for (const auto& entry : fs::recursive_directory_iterator(kRoot / dir)) {
      const auto ext = entry.path().extension();
      if (ext != ".cc" && ext != ".h" && ext != ".cu") continue;
      // In the joined literals: a pointer is often split over two lines.
      for (const std::string& text : string_literals(slurp(entry.path()))) {
        for (std::size_t at = text.find(kPointer); at != std::string::npos;
             at = text.find(kPointer, at + 1)) {
          std::size_t end = at + kPointer.size();
          while (end < text.size() &&
                 (std::isalnum(static_cast<unsigned char>(text[end])) || text[end] == '-')) {
            ++end;
          }
          const std::string anchor = text.substr(at + kPointer.size(), end - at - kPointer.size());
          ++pointers;
          EXPECT_TRUE(sections.count(anchor) == 1)
              << entry.path() << " points to #" << anchor << ", which docs/troubleshooting.md lacks";
        }
      }
    }
  }
  EXPECT_GE(pointers, 8u) << "the pointers of kQuoted were not found at all";
}

TEST(TroubleshootingDoc, FormatPatternMatchesFieldsAndEscapes) {
  const std::regex re = format_pattern("pool '{}' has {:.1f}% (x) {{y}}");
  EXPECT_TRUE(std::regex_match("pool 'p' has 2.5% (x) {y}", re));
  EXPECT_TRUE(std::regex_match("pool '<name>' has <n>% (x) {y}", re));
  EXPECT_FALSE(std::regex_match("pool 'p' has 2.5% x {y}", re));
  EXPECT_FALSE(std::regex_match("pool '' has 2.5% (x) {y}", re)) << "a field is never empty";
}

TEST(TroubleshootingDoc, StringLiteralsAreJoinedAndCommentsSkipped) {
  const auto l = string_literals(
      "f(\"a \" // don't\n  \"b\\\"c\", '\"', 1'000, \"d\"); /* \"e\" */ \"g\\n\"");
  ASSERT_EQ(l.size(), 3u);
  EXPECT_EQ(l[0], "a b\"c");
  EXPECT_EQ(l[1], "d");
  EXPECT_EQ(l[2], "g\n");
}

}  // namespace
}  // namespace ember::test
