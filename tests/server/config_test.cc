// Profiles: the built-ins, the example files, every file format, overrides and invalid files.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/config/profile.h"
#include "tests/test_seed.h"

namespace decode_indexer::config {
namespace {

using kernels::CacheFormat;
using kernels::RopeStyle;
using ::testing::HasSubstr;

const std::string kExamples = DI_CONFIG_EXAMPLES;

void ExpectSameProfile(const Profile& a, const Profile& b) {
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.num_heads, b.num_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.topk, b.topk);
  EXPECT_EQ(a.page_size, b.page_size);
  EXPECT_EQ(a.max_context, b.max_context);
  EXPECT_EQ(a.candidate_block_size, b.candidate_block_size);
  EXPECT_EQ(a.num_candidate_blocks, b.num_candidate_blocks);
  EXPECT_EQ(a.max_rows_per_sequence, b.max_rows_per_sequence);
  EXPECT_EQ(a.hadamard, b.hadamard);
  EXPECT_EQ(a.rope.style, b.rope.style);
  EXPECT_EQ(a.rope.dim_offset, b.rope.dim_offset);
  EXPECT_EQ(a.rope.rope_dim, b.rope.rope_dim);
  EXPECT_EQ(a.rope.theta, b.rope.theta);
  EXPECT_EQ(a.rope.yarn, b.rope.yarn);
  if (a.rope.yarn && b.rope.yarn) {
    EXPECT_EQ(a.rope.yarn_factor, b.rope.yarn_factor);
    EXPECT_EQ(a.rope.yarn_original_max_position, b.rope.yarn_original_max_position);
    EXPECT_EQ(a.rope.yarn_beta_fast, b.rope.yarn_beta_fast);
    EXPECT_EQ(a.rope.yarn_beta_slow, b.rope.yarn_beta_slow);
  }
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t i = 0; i < a.layers.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("layer ", i));
    EXPECT_EQ(a.layers[i].layer, b.layers[i].layer);
    EXPECT_EQ(a.layers[i].role, b.layers[i].role);
    EXPECT_EQ(a.layers[i].cache_layer, b.layers[i].cache_layer);
    EXPECT_EQ(a.layers[i].cache_format, b.layers[i].cache_format);
  }
}

// A scratch directory for files the tests write.
class TempDir {
 public:
  TempDir() {
    path_ = std::filesystem::temp_directory_path() /
            absl::StrCat("di_config_test_", ::getpid(), "_", std::random_device{}());
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string Write(const std::string& name, const std::string& text) const {
    std::string p = (path_ / name).string();
    std::ofstream(p) << text;
    return p;
  }

 private:
  std::filesystem::path path_;
};

TEST(BuiltinProfile, V32) {
  absl::StatusOr<Profile> p = BuiltinProfile("v32");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(ValidateProfile(*p).ok());
  EXPECT_EQ(p->num_heads, 64);
  EXPECT_EQ(p->head_dim, 128);
  EXPECT_EQ(p->topk, 2048);
  EXPECT_EQ(p->page_size, 64);
  EXPECT_EQ(p->max_context, 163840);
  EXPECT_EQ(p->candidate_block_size, 0);
  EXPECT_FALSE(p->hadamard);
  EXPECT_EQ(p->rope.style, RopeStyle::kNeox);
  EXPECT_EQ(p->rope.dim_offset, 0);
  EXPECT_EQ(p->rope.rope_dim, 64);
  EXPECT_TRUE(p->rope.yarn);
  EXPECT_EQ(p->rope.yarn_factor, 40.0);
  EXPECT_EQ(p->rope.yarn_original_max_position, 4096);
  EXPECT_EQ(p->rope.yarn_beta_fast, 32.0);
  EXPECT_EQ(p->rope.yarn_beta_slow, 1.0);
  ASSERT_EQ(p->layers.size(), 61u);
  for (const LayerSpec& l : p->layers) {
    EXPECT_EQ(l.role, LayerRole::kDense);
    EXPECT_EQ(l.cache_layer, l.layer);
    EXPECT_EQ(l.cache_format, CacheFormat::kFp8);
  }
  EXPECT_EQ(p->CacheLayers().size(), 61u);
}

TEST(BuiltinProfile, V41) {
  absl::StatusOr<Profile> p = BuiltinProfile("v41");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(ValidateProfile(*p).ok());
  EXPECT_EQ(p->num_heads, 32);
  EXPECT_EQ(p->topk, 512);
  EXPECT_EQ(p->candidate_block_size, 8);
  EXPECT_EQ(p->num_candidate_blocks, 2048);
  EXPECT_EQ(p->max_context, 1048576);
  EXPECT_EQ(p->rope.style, RopeStyle::kInterleaved);
  EXPECT_EQ(p->rope.dim_offset, 64);
  EXPECT_EQ(p->rope.rope_dim, 64);
  EXPECT_FALSE(p->rope.yarn);
  ASSERT_EQ(p->layers.size(), 61u);
  EXPECT_EQ(p->CacheLayers(), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(p->layers[3].role, LayerRole::kCandidateSource);
  for (int32_t i = 4; i < 61; ++i) {
    EXPECT_EQ(p->layers[i].role, LayerRole::kCandidateConsumer);
    EXPECT_EQ(p->SourceLayerOf(i), 3);
  }
  for (const LayerSpec& l : p->layers) EXPECT_EQ(l.cache_format, CacheFormat::kFp4);
  EXPECT_EQ(p->FindLayer(61), nullptr);
  EXPECT_EQ(p->FindLayer(-1), nullptr);
}

TEST(LoadProfile, BuiltinNamesAndUnknownName) {
  absl::StatusOr<Profile> p = LoadProfile("v41");
  ASSERT_TRUE(p.ok());
  ExpectSameProfile(*p, *BuiltinProfile("v41"));
  absl::StatusOr<Profile> bad = LoadProfile("v99");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(bad.status().message(), HasSubstr("v99"));
}

TEST(LoadProfile, ExampleToml) {
  absl::StatusOr<Profile> p = LoadProfile(kExamples + "/v41-small.toml");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->name, "v41-small");
  EXPECT_EQ(p->num_heads, 8);
  EXPECT_EQ(p->head_dim, 128);  // from base v41
  EXPECT_EQ(p->topk, 64);
  EXPECT_EQ(p->page_size, 16);
  EXPECT_EQ(p->num_candidate_blocks, 16);
  ASSERT_EQ(p->layers.size(), 6u);
  EXPECT_EQ(p->layers[0].role, LayerRole::kDense);
  EXPECT_EQ(p->layers[1].role, LayerRole::kDense);
  EXPECT_EQ(p->layers[2].role, LayerRole::kCandidateSource);
  for (int i = 3; i < 6; ++i) {
    EXPECT_EQ(p->layers[i].role, LayerRole::kCandidateConsumer);
    EXPECT_EQ(p->layers[i].cache_layer, 2);
  }
  for (const LayerSpec& l : p->layers) EXPECT_EQ(l.cache_format, CacheFormat::kFp4);
}

TEST(LoadProfile, ExampleYamlIsTheV32Builtin) {
  absl::StatusOr<Profile> p = LoadProfile(kExamples + "/v32.yaml");
  ASSERT_TRUE(p.ok()) << p.status();
  Profile expected = *BuiltinProfile("v32");
  expected.name = "v32-file";
  ExpectSameProfile(*p, expected);
}

TEST(LoadProfile, ExampleJson) {
  absl::StatusOr<Profile> p = LoadProfile(kExamples + "/custom.json");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->name, "custom");
  EXPECT_EQ(p->head_dim, 64);
  EXPECT_TRUE(p->hadamard);
  EXPECT_EQ(p->rope.style, RopeStyle::kNeox);
  EXPECT_EQ(p->rope.theta, 50000.0);
  EXPECT_FALSE(p->rope.yarn);
  ASSERT_EQ(p->layers.size(), 4u);
  EXPECT_EQ(p->layers[0].cache_format, CacheFormat::kFp8);
  EXPECT_EQ(p->layers[1].cache_format, CacheFormat::kFp4);
  // The consumer takes its source's format.
  EXPECT_EQ(p->layers[2].cache_format, CacheFormat::kFp4);
  EXPECT_EQ(p->layers[2].cache_layer, 1);
  EXPECT_EQ(p->CacheLayers(), (std::vector<int32_t>{0, 1, 3}));
}

TEST(LoadProfile, OverridesOnABase) {
  TempDir dir;
  // cache_format without a plan re-formats the base's layers.
  absl::StatusOr<Profile> p =
      LoadProfile(dir.Write("fp8.toml", "base = \"v41\"\ncache_format = \"fp8\"\ntopk = 300\n"));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->name, "fp8");  // the file's stem
  EXPECT_EQ(p->topk, 300);
  EXPECT_EQ(p->layers.size(), 61u);
  for (const LayerSpec& l : p->layers) EXPECT_EQ(l.cache_format, CacheFormat::kFp8);
  // YaRN switched off and a different plan.
  p = LoadProfile(dir.Write("plain.yml",
                            "base: v32\nrope: {yarn: false, theta: 20000}\n"
                            "layers: {count: 5, dense: [0, [3, 4]], source: 1}\n"
                            "candidate_block_size: 16\nnum_candidate_blocks: 64\n"));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->rope.yarn);
  EXPECT_EQ(p->rope.theta, 20000.0);
  EXPECT_EQ(p->rope.style, RopeStyle::kNeox);  // untouched
  ASSERT_EQ(p->layers.size(), 5u);
  EXPECT_EQ(p->layers[0].role, LayerRole::kDense);
  EXPECT_EQ(p->layers[1].role, LayerRole::kCandidateSource);
  EXPECT_EQ(p->layers[2].role, LayerRole::kCandidateConsumer);
  EXPECT_EQ(p->layers[3].role, LayerRole::kDense);
  EXPECT_EQ(p->layers[4].role, LayerRole::kDense);
}

// A random profile written in each format loads back exactly.
std::string FormatDouble(double v) { return absl::StrFormat("%.17g", v); }

TEST(LoadProfile, RandomProfilesRoundTripInEveryFormat) {
  const uint64_t seed = ::decode_indexer::testing::TestSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  TempDir dir;
  for (int iter = 0; iter < 12; ++iter) {
    Profile p;
    p.name = absl::StrCat("random", iter);
    p.num_heads = int32_t(uni(1, 128));
    p.head_dim = int32_t(32 << uni(0, 3));
    p.topk = int32_t(uni(1, 4096));
    p.page_size = int32_t(uni(1, 256));
    p.max_context = uni(1, 2000000);
    p.max_rows_per_sequence = int32_t(uni(1, 16));
    p.hadamard = uni(0, 1);
    const bool candidates = uni(0, 1);
    if (candidates) {
      p.candidate_block_size = int32_t(uni(1, 32));
      p.num_candidate_blocks = int32_t(uni(1, 4096));
    }
    p.rope.style = uni(0, 1) ? RopeStyle::kNeox : RopeStyle::kInterleaved;
    p.rope.rope_dim = int32_t(2 * uni(1, p.head_dim / 2));
    p.rope.dim_offset = int32_t(uni(0, p.head_dim - p.rope.rope_dim));
    p.rope.theta = std::uniform_real_distribution<double>(2.0, 1e6)(rng);
    p.rope.yarn = uni(0, 1);
    if (p.rope.yarn) {
      p.rope.yarn_factor = std::uniform_real_distribution<double>(1.0, 64.0)(rng);
      p.rope.yarn_original_max_position = uni(1, 1 << 20);
      p.rope.yarn_beta_slow = std::uniform_real_distribution<double>(0.5, 2.0)(rng);
      p.rope.yarn_beta_fast = p.rope.yarn_beta_slow + uni(1, 64);
    }
    const int32_t n = int32_t(uni(1, 12));
    const int32_t source = candidates ? int32_t(uni(0, n - 1)) : -1;
    for (int32_t i = 0; i < n; ++i) {
      LayerSpec l{i, LayerRole::kDense, i, uni(0, 1) ? CacheFormat::kFp8 : CacheFormat::kFp4};
      if (i == source) l.role = LayerRole::kCandidateSource;
      if (source >= 0 && i != source && uni(0, 1)) {
        l.role = LayerRole::kCandidateConsumer;
        l.cache_layer = source;
      }
      p.layers.push_back(l);
    }
    for (LayerSpec& l : p.layers) l.cache_format = p.layers[l.cache_layer].cache_format;
    ASSERT_TRUE(ValidateProfile(p).ok()) << ValidateProfile(p);

    auto role = [](LayerRole r) {
      return r == LayerRole::kDense             ? "dense"
             : r == LayerRole::kCandidateSource ? "source"
                                                : "consumer";
    };
    auto fmt = [](CacheFormat f) { return f == CacheFormat::kFp8 ? "fp8" : "fp4"; };
    const char* style = p.rope.style == RopeStyle::kNeox ? "neox" : "interleaved";
    // TOML
    std::string toml = absl::StrCat(
        "name = \"", p.name, "\"\nnum_heads = ", p.num_heads, "\nhead_dim = ", p.head_dim,
        "\ntopk = ", p.topk, "\npage_size = ", p.page_size, "\nmax_context = ", p.max_context,
        "\ncandidate_block_size = ", p.candidate_block_size,
        "\nnum_candidate_blocks = ", p.num_candidate_blocks,
        "\nmax_rows_per_sequence = ", p.max_rows_per_sequence,
        "\nhadamard = ", p.hadamard ? "true" : "false", "\n");
    for (const LayerSpec& l : p.layers) {
      absl::StrAppend(&toml, "[[layers]]\nlayer = ", l.layer, "\nrole = \"", role(l.role),
                      "\"\ncache_layer = ", l.cache_layer, "\ncache_format = \"",
                      fmt(l.cache_format), "\"\n");
    }
    absl::StrAppend(&toml, "[rope]\nstyle = \"", style, "\"\ndim_offset = ", p.rope.dim_offset,
                    "\ndim = ", p.rope.rope_dim, "\ntheta = ", FormatDouble(p.rope.theta), "\n");
    if (p.rope.yarn) {
      absl::StrAppend(&toml, "[rope.yarn]\nfactor = ", FormatDouble(p.rope.yarn_factor),
                      "\noriginal_max_position = ", p.rope.yarn_original_max_position,
                      "\nbeta_fast = ", FormatDouble(p.rope.yarn_beta_fast),
                      "\nbeta_slow = ", FormatDouble(p.rope.yarn_beta_slow), "\n");
    } else {
      absl::StrAppend(&toml, "yarn = false\n");
    }
    // YAML and JSON share the flow syntax of JSON (YAML is a superset).
    std::string layers;
    for (const LayerSpec& l : p.layers) {
      absl::StrAppend(&layers, layers.empty() ? "" : ", ", "{\"layer\": ", l.layer,
                      ", \"role\": \"", role(l.role), "\", \"cache_layer\": ", l.cache_layer,
                      ", \"cache_format\": \"", fmt(l.cache_format), "\"}");
    }
    std::string yarn =
        p.rope.yarn
            ? absl::StrCat("{\"factor\": ", FormatDouble(p.rope.yarn_factor),
                           ", \"original_max_position\": ", p.rope.yarn_original_max_position,
                           ", \"beta_fast\": ", FormatDouble(p.rope.yarn_beta_fast),
                           ", \"beta_slow\": ", FormatDouble(p.rope.yarn_beta_slow), "}")
            : "false";
    std::string json =
        absl::StrCat("{\"name\": \"", p.name, "\", \"num_heads\": ", p.num_heads,
                     ", \"head_dim\": ", p.head_dim, ", \"topk\": ", p.topk,
                     ", \"page_size\": ", p.page_size, ", \"max_context\": ", p.max_context,
                     ", \"candidate_block_size\": ", p.candidate_block_size,
                     ", \"num_candidate_blocks\": ", p.num_candidate_blocks,
                     ", \"max_rows_per_sequence\": ", p.max_rows_per_sequence,
                     ", \"hadamard\": ", p.hadamard ? "true" : "false",
                     ", \"rope\": {\"style\": \"", style, "\", \"dim_offset\": ", p.rope.dim_offset,
                     ", \"dim\": ", p.rope.rope_dim, ", \"theta\": ", FormatDouble(p.rope.theta),
                     ", \"yarn\": ", yarn, "}, \"layers\": [", layers, "]}");
    for (const auto& [file, text] : {std::pair{absl::StrCat("r", iter, ".toml"), toml},
                                     std::pair{absl::StrCat("r", iter, ".yaml"), json},
                                     std::pair{absl::StrCat("r", iter, ".json"), json}}) {
      SCOPED_TRACE(file);
      absl::StatusOr<Profile> loaded = LoadProfile(dir.Write(file, text));
      ASSERT_TRUE(loaded.ok()) << loaded.status() << "\n" << text;
      ExpectSameProfile(*loaded, p);
    }
  }
}

struct BadCase {
  std::string file;
  std::string text;
  std::string message;
};

TEST(LoadProfile, InvalidFilesSayWhatIsWrong) {
  TempDir dir;
  const std::vector<BadCase> cases = {
      {"a.toml", "base = \"v41\"\ntopkk = 3\n", "topkk: unknown key"},
      {"b.toml", "base = \"v41\"\n[rope.yarn]\nfactr = 2.0\n", "rope.yarn.factr: unknown key"},
      {"c.toml", "base = \"v41\"\ntopk = \"many\"\n", "topk: expected an integer"},
      {"d.toml", "base = \"v41\"\nhead_dim = 100\n", "head_dim must be a multiple of 32"},
      {"e.toml", "base = \"v41\"\n[rope]\nstyle = \"spiral\"\n", "rope.style: expected neox"},
      {"f.toml", "base = \"v41\"\ntopk = \n", "f.toml:2"},
      {"g.toml", "base = \"v99\"\n", "base: no built-in profile \"v99\""},
      {"h.yaml", "base: v41\nlayers: [{layer: 0, role: consumer, cache_layer: 0}]\n",
       "a consumer's cache_layer must be a candidate source"},
      {"i.yaml", "base: v41\nlayers: [{layer: 0, role: boss}]\n", "layers[0].role"},
      {"j.json", "{\"base\": \"v41\", \"page_size\": 0}", "page_size must be in [1, 4096]"},
      {"k.json", "{\"base\": \"v41\", ", "k.json"},
      {"l.json", "{\"num_heads\": 4}", "layers: no layer plan"},
      {"m.json", "{\"base\": \"v32\", \"layers\": {\"count\": 4, \"source\": 1}}",
       "candidate layers need candidate_block_size"},
      {"n.json", "{\"base\": \"v32\", \"rope\": {\"dim\": 66, \"dim_offset\": 64}}",
       "rope span [64, 130) must lie inside"},
      {"o.json", "{\"base\": \"v32\", \"layers\": {\"count\": 3, \"dense\": [[1, 7]]}}",
       "layers.dense[0]: range [1, 7] is not inside [0, 2]"},
      {"p.json", "{\"base\": \"v41\", \"candidate_block_size\": 0}",
       "candidate_block_size and num_candidate_blocks must be both 0"},
      {"q.ini", "x = 1\n", "unknown file type"},
  };
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.file);
    absl::StatusOr<Profile> p = LoadProfile(dir.Write(c.file, c.text));
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
    EXPECT_THAT(p.status().message(), HasSubstr(c.message));
  }
  absl::StatusOr<Profile> missing = LoadProfile("/nonexistent/profile.toml");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

TEST(ValidateProfile, RejectsBrokenPlans) {
  Profile p = *BuiltinProfile("v41");
  p.layers[10].cache_layer = 2;  // a dense layer, not a source
  EXPECT_THAT(ValidateProfile(p).message(), HasSubstr("layers[10]"));
  p = *BuiltinProfile("v41");
  p.layers[10].cache_format = CacheFormat::kFp8;  // reads an FP4 cache
  EXPECT_THAT(ValidateProfile(p).message(), HasSubstr("must match"));
  p = *BuiltinProfile("v41");
  p.layers[5].layer = 6;
  EXPECT_THAT(ValidateProfile(p).message(), HasSubstr("0..n-1"));
  p = *BuiltinProfile("v32");
  p.rope.yarn_beta_fast = 0.5;
  EXPECT_THAT(ValidateProfile(p).message(), HasSubstr("beta_fast > beta_slow"));
  p = *BuiltinProfile("v32");
  p.max_context = int64_t{1} << 32;
  EXPECT_THAT(ValidateProfile(p).message(), HasSubstr("max_context"));
}

}  // namespace
}  // namespace decode_indexer::config
