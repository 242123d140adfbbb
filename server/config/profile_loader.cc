// LoadProfile: a built-in name or a profile file. TOML, YAML and JSON files are first turned
// into one JSON tree, so a single schema walker applies every format the same way and names
// the offending key by its path ("rope.yarn.factor").
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "server/config/profile.h"
#include "toml++/toml.h"
#include "yaml-cpp/yaml.h"

namespace decode_indexer::config {
namespace {

using json = nlohmann::json;
using kernels::CacheFormat;
using kernels::RopeStyle;

// ---- Format -> JSON tree --------------------------------------------------------------------

json TomlToJson(const toml::node& node) {
  if (const toml::table* t = node.as_table()) {
    json out = json::object();
    for (const auto& [key, value] : *t) out[std::string(key.str())] = TomlToJson(value);
    return out;
  }
  if (const toml::array* a = node.as_array()) {
    json out = json::array();
    for (const toml::node& value : *a) out.push_back(TomlToJson(value));
    return out;
  }
  if (auto v = node.value_exact<int64_t>()) return *v;
  if (auto v = node.value_exact<double>()) return *v;
  if (auto v = node.value_exact<bool>()) return *v;
  if (auto v = node.value_exact<std::string>()) return *v;
  // Dates and times mean nothing in a profile; keep them as text so the walker rejects them.
  std::ostringstream text;
  text << "<TOML " << node.type() << ">";
  return text.str();
}

json YamlToJson(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map: {
      json out = json::object();
      for (const auto& kv : node) out[kv.first.as<std::string>()] = YamlToJson(kv.second);
      return out;
    }
    case YAML::NodeType::Sequence: {
      json out = json::array();
      for (const auto& v : node) out.push_back(YamlToJson(v));
      return out;
    }
    case YAML::NodeType::Scalar: {
      // YAML scalars are untyped text; a quoted scalar (tag "!") stays a string, others are
      // read as the narrowest type they spell.
      const std::string& s = node.Scalar();
      if (node.Tag() == "!") return s;
      int64_t i;
      if (YAML::convert<int64_t>::decode(node, i)) return i;
      double d;
      if (YAML::convert<double>::decode(node, d)) return d;
      bool b;
      if (YAML::convert<bool>::decode(node, b)) return b;
      return s;
    }
    default:
      return nullptr;
  }
}

// Parses a profile document of type `ext` (".toml", ".yaml"/".yml", ".json"); `label` (the
// file's path) prefixes the messages.
absl::StatusOr<json> ParseTree(std::string_view text, const std::string& ext,
                               const std::string& label) {
  try {
    if (ext == ".toml") {
      toml::table t = toml::parse(text, std::string_view(label));
      return TomlToJson(t);
    }
    if (ext == ".yaml" || ext == ".yml") {
      YAML::Node root = YAML::Load(std::string(text));
      if (!root.IsMap()) {
        return absl::InvalidArgumentError(absl::StrCat(label, ": the top level must be a map"));
      }
      return YamlToJson(root);
    }
    if (ext == ".json") {
      json root = json::parse(text, nullptr, /*allow_exceptions=*/true, /*ignore_comments=*/true);
      return root;
    }
  } catch (const toml::parse_error& e) {
    return absl::InvalidArgumentError(absl::StrCat(label, ":", e.source().begin.line, ":",
                                                   e.source().begin.column, ": ",
                                                   std::string(e.description())));
  } catch (const std::exception& e) {
    // yaml-cpp and nlohmann report the line and column inside what().
    return absl::InvalidArgumentError(absl::StrCat(label, ": ", e.what()));
  }
  return absl::InvalidArgumentError(absl::StrCat("profile ", label, ": unknown file type \"", ext,
                                                 "\" (use .toml, .yaml, .yml or .json)"));
}

absl::StatusOr<json> ReadTree(const std::string& path) {
  std::string ext = absl::AsciiStrToLower(std::filesystem::path(path).extension().string());
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return absl::NotFoundError(absl::StrCat("profile file ", path, " does not exist"));
  }
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in && !in.eof()) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot read"));
  return ParseTree(text.str(), ext, path);
}

// ---- The schema walker ----------------------------------------------------------------------

// Walks one object of the tree, reading known keys and rejecting unknown ones, so a typo in
// a profile is an error rather than a silently ignored default.
class Reader {
 public:
  Reader(const json& obj, std::string path) : obj_(obj), path_(std::move(path)) {}

  std::string KeyPath(const std::string& key) const {
    return path_.empty() ? key : absl::StrCat(path_, ".", key);
  }
  bool Has(const std::string& key) {
    seen_.insert(key);
    return obj_.contains(key);
  }
  const json& At(const std::string& key) const { return obj_.at(key); }

  absl::Status Int(const std::string& key, int64_t lo, int64_t hi, int64_t* out) {
    if (!Has(key)) return absl::OkStatus();
    const json& v = obj_.at(key);
    if (!v.is_number_integer()) return Error(key, "expected an integer");
    int64_t x = v.get<int64_t>();
    if (x < lo || x > hi) {
      return Error(key, absl::StrCat("must be in [", lo, ", ", hi, "], got ", x));
    }
    *out = x;
    return absl::OkStatus();
  }
  absl::Status Int32(const std::string& key, int32_t* out) {
    int64_t v = *out;
    absl::Status s = Int(key, 0, std::numeric_limits<int32_t>::max(), &v);
    *out = static_cast<int32_t>(v);
    return s;
  }
  absl::Status Double(const std::string& key, double* out) {
    if (!Has(key)) return absl::OkStatus();
    const json& v = obj_.at(key);
    if (!v.is_number()) return Error(key, "expected a number");
    double x = v.get<double>();
    if (!std::isfinite(x)) return Error(key, "must be finite");
    *out = x;
    return absl::OkStatus();
  }
  absl::Status Bool(const std::string& key, bool* out) {
    if (!Has(key)) return absl::OkStatus();
    const json& v = obj_.at(key);
    if (!v.is_boolean()) return Error(key, "expected true or false");
    *out = v.get<bool>();
    return absl::OkStatus();
  }
  absl::Status String(const std::string& key, std::string* out) {
    if (!Has(key)) return absl::OkStatus();
    const json& v = obj_.at(key);
    if (!v.is_string()) return Error(key, "expected a string");
    *out = v.get<std::string>();
    return absl::OkStatus();
  }
  absl::Status Format(const std::string& key, CacheFormat* out) {
    std::string s;
    if (!Has(key)) return absl::OkStatus();
    if (absl::Status st = String(key, &s); !st.ok()) return st;
    s = absl::AsciiStrToLower(s);
    if (s == "fp8") {
      *out = CacheFormat::kFp8;
    } else if (s == "fp4") {
      *out = CacheFormat::kFp4;
    } else {
      return Error(key, absl::StrCat("expected \"fp8\" or \"fp4\", got \"", s, "\""));
    }
    return absl::OkStatus();
  }

  // Every key the schema did not read is a mistake.
  absl::Status Finish() const {
    for (const auto& [key, value] : obj_.items()) {
      if (!seen_.contains(key)) return Error(key, "unknown key");
    }
    return absl::OkStatus();
  }

  absl::Status Error(const std::string& key, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(KeyPath(key), ": ", what));
  }

 private:
  const json& obj_;
  std::string path_;
  std::set<std::string> seen_;
};

absl::Status ApplyRope(const json& node, const std::string& path, kernels::RopeParams* rope) {
  if (!node.is_object())
    return absl::InvalidArgumentError(absl::StrCat(path, ": expected a table"));
  Reader r(node, path);
  std::string style;
  if (r.Has("style")) {
    DI_RETURN_IF_ERROR(r.String("style", &style));
    style = absl::AsciiStrToLower(style);
    if (style == "neox") {
      rope->style = RopeStyle::kNeox;
    } else if (style == "interleaved") {
      rope->style = RopeStyle::kInterleaved;
    } else if (style == "none") {
      rope->style = RopeStyle::kNone;
    } else {
      return r.Error("style",
                     absl::StrCat("expected neox, interleaved or none, got \"", style, "\""));
    }
  }
  DI_RETURN_IF_ERROR(r.Int32("dim_offset", &rope->dim_offset));
  DI_RETURN_IF_ERROR(r.Int32("dim", &rope->rope_dim));
  DI_RETURN_IF_ERROR(r.Double("theta", &rope->theta));
  if (r.Has("yarn")) {
    const json& y = r.At("yarn");
    // `yarn = false` turns YaRN off (plain frequencies); a table turns it on.
    if (y.is_boolean()) {
      rope->yarn = y.get<bool>();
    } else if (y.is_object()) {
      rope->yarn = true;
      Reader yr(y, r.KeyPath("yarn"));
      DI_RETURN_IF_ERROR(yr.Double("factor", &rope->yarn_factor));
      DI_RETURN_IF_ERROR(yr.Int("original_max_position", 1, std::numeric_limits<int32_t>::max(),
                                &rope->yarn_original_max_position));
      DI_RETURN_IF_ERROR(yr.Double("beta_fast", &rope->yarn_beta_fast));
      DI_RETURN_IF_ERROR(yr.Double("beta_slow", &rope->yarn_beta_slow));
      DI_RETURN_IF_ERROR(yr.Finish());
    } else {
      return r.Error("yarn", "expected a table or false");
    }
  }
  return r.Finish();
}

// One entry of `dense`: a layer id or an inclusive [first, last] range.
absl::Status ReadRange(const json& v, const std::string& path, int64_t count, int64_t* first,
                       int64_t* last) {
  if (v.is_number_integer()) {
    *first = *last = v.get<int64_t>();
  } else if (v.is_array() && v.size() == 2 && v[0].is_number_integer() &&
             v[1].is_number_integer()) {
    *first = v[0].get<int64_t>();
    *last = v[1].get<int64_t>();
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected a layer id or an inclusive [first, last] range"));
  }
  if (*first < 0 || *last < *first || *last >= count) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": range [", *first, ", ", *last,
                                                   "] is not inside [0, ", count - 1, "]"));
  }
  return absl::OkStatus();
}

// The compact plan {count, dense: [ranges], source: N}: the listed layers are dense, `source`
// publishes candidates, every other layer consumes them. Without `source` every layer is dense.
absl::Status ApplyCompactPlan(const json& node, CacheFormat format, std::vector<LayerSpec>* out) {
  Reader r(node, "layers");
  int64_t count = 0;
  if (!r.Has("count")) return r.Error("count", "the compact layer plan needs a count");
  DI_RETURN_IF_ERROR(r.Int("count", 1, 4096, &count));
  int64_t source = -1;
  DI_RETURN_IF_ERROR(r.Int("source", 0, count - 1, &source));
  std::vector<bool> dense(count, source < 0);
  if (r.Has("dense")) {
    const json& d = r.At("dense");
    if (!d.is_array()) return r.Error("dense", "expected a list of layer ids or ranges");
    for (size_t i = 0; i < d.size(); ++i) {
      int64_t first = 0, last = 0;
      DI_RETURN_IF_ERROR(
          ReadRange(d[i], absl::StrCat("layers.dense[", i, "]"), count, &first, &last));
      for (int64_t l = first; l <= last; ++l) dense[l] = true;
    }
  }
  if (source >= 0 && dense[source]) {
    return r.Error("source", absl::StrCat("layer ", source, " is also listed as dense"));
  }
  DI_RETURN_IF_ERROR(r.Finish());
  out->clear();
  for (int32_t i = 0; i < count; ++i) {
    LayerSpec l{i, LayerRole::kDense, i, format};
    if (i == source) {
      l.role = LayerRole::kCandidateSource;
    } else if (!dense[i]) {
      l.role = LayerRole::kCandidateConsumer;
      l.cache_layer = static_cast<int32_t>(source);
    }
    out->push_back(l);
  }
  return absl::OkStatus();
}

absl::Status ApplyLayerList(const json& node, CacheFormat format, std::vector<LayerSpec>* out) {
  out->clear();
  for (size_t i = 0; i < node.size(); ++i) {
    std::string path = absl::StrCat("layers[", i, "]");
    if (!node[i].is_object()) return absl::InvalidArgumentError(path + ": expected a table");
    Reader r(node[i], path);
    LayerSpec l;
    l.layer = static_cast<int32_t>(i);
    l.cache_format = format;
    DI_RETURN_IF_ERROR(r.Int32("layer", &l.layer));
    std::string role = "dense";
    DI_RETURN_IF_ERROR(r.String("role", &role));
    role = absl::AsciiStrToLower(role);
    if (role == "dense") {
      l.role = LayerRole::kDense;
    } else if (role == "source" || role == "candidate_source") {
      l.role = LayerRole::kCandidateSource;
    } else if (role == "consumer" || role == "candidate_consumer") {
      l.role = LayerRole::kCandidateConsumer;
    } else {
      return r.Error("role",
                     absl::StrCat("expected dense, source or consumer, got \"", role, "\""));
    }
    l.cache_layer = l.layer;
    if (l.role == LayerRole::kCandidateConsumer && !r.Has("cache_layer")) {
      return r.Error("cache_layer", "a consumer must name the source layer whose cache it reads");
    }
    DI_RETURN_IF_ERROR(r.Int32("cache_layer", &l.cache_layer));
    DI_RETURN_IF_ERROR(r.Format("cache_format", &l.cache_format));
    DI_RETURN_IF_ERROR(r.Finish());
    out->push_back(l);
  }
  // A consumer reads its source's cache, so unless it says otherwise it takes that format.
  for (size_t i = 0; i < node.size(); ++i) {
    LayerSpec& l = (*out)[i];
    if (l.role == LayerRole::kCandidateConsumer && !node[i].contains("cache_format") &&
        l.cache_layer >= 0 && l.cache_layer < static_cast<int32_t>(out->size())) {
      l.cache_format = (*out)[l.cache_layer].cache_format;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Profile> ApplyTree(const json& root, const std::string& file) {
  if (!root.is_object()) return absl::InvalidArgumentError("the top level must be a table");
  Reader r(root, "");
  std::string base = "";
  DI_RETURN_IF_ERROR(r.String("base", &base));
  Profile p;
  if (!base.empty()) {
    absl::StatusOr<Profile> b = BuiltinProfile(base);
    if (!b.ok()) return r.Error("base", std::string(b.status().message()));
    p = *std::move(b);
  }
  // A file without a name is known by its stem.
  p.name = std::filesystem::path(file).stem().string();
  DI_RETURN_IF_ERROR(r.String("name", &p.name));
  DI_RETURN_IF_ERROR(r.Int32("num_heads", &p.num_heads));
  DI_RETURN_IF_ERROR(r.Int32("head_dim", &p.head_dim));
  DI_RETURN_IF_ERROR(r.Int32("topk", &p.topk));
  DI_RETURN_IF_ERROR(r.Int32("page_size", &p.page_size));
  DI_RETURN_IF_ERROR(r.Int("max_context", 1, std::numeric_limits<int64_t>::max(), &p.max_context));
  DI_RETURN_IF_ERROR(r.Int32("candidate_block_size", &p.candidate_block_size));
  DI_RETURN_IF_ERROR(r.Int32("num_candidate_blocks", &p.num_candidate_blocks));
  DI_RETURN_IF_ERROR(r.Int32("max_rows_per_sequence", &p.max_rows_per_sequence));
  DI_RETURN_IF_ERROR(r.Bool("hadamard", &p.hadamard));

  // cache_format is the default of every layer the file does not give one.
  CacheFormat format = p.layers.empty() ? CacheFormat::kFp8 : p.layers.front().cache_format;
  bool format_given = r.Has("cache_format");
  DI_RETURN_IF_ERROR(r.Format("cache_format", &format));

  if (r.Has("rope")) DI_RETURN_IF_ERROR(ApplyRope(r.At("rope"), "rope", &p.rope));

  if (r.Has("layers")) {
    const json& layers = r.At("layers");
    if (layers.is_array()) {
      DI_RETURN_IF_ERROR(ApplyLayerList(layers, format, &p.layers));
    } else if (layers.is_object()) {
      DI_RETURN_IF_ERROR(ApplyCompactPlan(layers, format, &p.layers));
    } else {
      return r.Error("layers", "expected a list of layers or a plan {count, dense, source}");
    }
  } else if (format_given) {
    for (LayerSpec& l : p.layers) l.cache_format = format;
  }
  if (p.layers.empty()) {
    return r.Error("layers", "no layer plan (give `layers` or a `base` profile)");
  }
  DI_RETURN_IF_ERROR(r.Finish());
  return p;
}

#undef DI_RETURN_IF_ERROR

}  // namespace

absl::StatusOr<Profile> ParseProfileText(std::string_view text, const std::string& format) {
  absl::StatusOr<json> tree = ParseTree(text, absl::StrCat(".", format), "profile");
  if (!tree.ok()) return tree.status();
  absl::StatusOr<Profile> profile = ApplyTree(*tree, "profile");
  if (!profile.ok()) return profile.status();
  if (absl::Status s = ValidateProfile(*profile); !s.ok()) return s;
  return profile;
}

absl::StatusOr<Profile> LoadProfile(const std::string& name_or_path) {
  absl::StatusOr<Profile> profile;
  if (name_or_path.find('/') == std::string::npos && name_or_path.find('.') == std::string::npos) {
    profile = BuiltinProfile(name_or_path);
  } else {
    absl::StatusOr<json> tree = ReadTree(name_or_path);
    if (!tree.ok()) return tree.status();
    profile = ApplyTree(*tree, name_or_path);
    if (!profile.ok()) {
      return absl::Status(profile.status().code(),
                          absl::StrCat(name_or_path, ": ", profile.status().message()));
    }
  }
  if (!profile.ok()) return profile.status();
  if (absl::Status s = ValidateProfile(*profile); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(name_or_path, ": ", s.message()));
  }
  return profile;
}

}  // namespace decode_indexer::config
