"""The planted bugs of the mutation check (run.py): each replaces one exact snippet of the
source (which must occur exactly once) and names the test binaries expected to catch it.
Kept small and aimed at the CPU math, the validation and the commit logic."""

MATH_TESTS = ["kernels_test", "executor_test", "decode_test"]

PLANTS = [
    {
        "name": "relu-dropped",
        "what": "FP8 logits: the head's dot product is not clamped at 0 (relu dropped)",
        "file": "kernels/cpu/engine.cc",
        "old": "logit[t] += w * (dot[t] > 0.0 ? dot[t] : 0.0);",
        "new": "logit[t] += w * dot[t];",
        "tests": MATH_TESTS,
    },
    {
        "name": "key-scale-dropped",
        "what": "FP8 logits: the key scale is not applied after the head sum",
        "file": "kernels/cpu/engine.cc",
        "old": "out[t] = static_cast<float>(logit[t] * s.key_scales[t]);",
        "new": "out[t] = static_cast<float>(logit[t]);",
        "tests": MATH_TESTS,
    },
    {
        "name": "ties-to-higher-position",
        "what": "top-k: ties at the K-th value go to the higher position",
        "file": "kernels/cpu/engine.cc",
        "old": """  int32_t ties_left = k - above;
  int32_t n = 0;
  for (int32_t i = 0; i < count && n < k; ++i) {
    const float v = logits[i];
    if (v > kth || (v == kth && ties_left > 0)) {""",
        "new": """  int32_t ties_left = k - above;
  int32_t skip = -ties_left;
  for (int32_t i = 0; i < count; ++i) skip += logits[i] == kth ? 1 : 0;
  int32_t n = 0;
  for (int32_t i = 0; i < count && n < k; ++i) {
    const float v = logits[i];
    if (v > kth || (v == kth && skip-- <= 0)) {""",
        "tests": MATH_TESTS,
    },
    {
        "name": "dense-topk-row-length-plus-one",
        "what": "dense top-k: a row also ranks the position at its length (one past its end)",
        "file": "kernels/cpu/engine.cc",
        "old": """  ForGroups(args.cache, args.rows, args.q, [&](int32_t r, const float* logits, ThreadScratch& s) {
    const int32_t length = args.rows.row_length[r];""",
        "new": """  ForGroups(args.cache, args.rows, args.q, [&](int32_t r, const float* logits, ThreadScratch& s) {
    const int32_t length = args.rows.row_length[r] + 1;""",
        "tests": MATH_TESTS,
    },
    {
        "name": "newest-block-not-forced",
        "what": "candidate blocks: the newest block no longer always wins (spec section 7)",
        "file": "kernels/cpu/engine.cc",
        "old": "  scores[blocks - 1] = std::numeric_limits<float>::infinity();\n",
        "new": "",
        "tests": MATH_TESTS,
    },
    {
        "name": "fp8-rounding-half-up",
        "what": "FP8 quantizer: ties round up instead of to even",
        "file": "kernels/include/decode_indexer/kernels/quant.h",
        "old": """    const uint32_t half = 0x80000u;
    if (rest > half || (rest == half && (code & 1u))) ++code;""",
        "new": """    const uint32_t half = 0x80000u;
    if (rest >= half) ++code;""",
        "tests": MATH_TESTS,
    },
    {
        "name": "row-length-off-by-one",
        "what": "executor: causal row j of a request scores L - n + j positions, not L - n + j + 1",
        "file": "server/exec/planner.cc",
        "old": "plan.row_length.push_back(static_cast<int32_t>(L - in.num_rows + j + 1));",
        "new": "plan.row_length.push_back(static_cast<int32_t>(L - in.num_rows + j));",
        "tests": ["executor_test", "decode_test"],
    },
    {
        "name": "shape-check-removed",
        "what": "validation: a tensor's shape is no longer compared with the expected one",
        "file": "server/service/request_decode.cc",
        "old": "    shape_ok = dims[i].value == kFree ? t.shape(i) >= 0 : t.shape(i) == dims[i].value;",
        "new": "    shape_ok = dims[i].value == kFree ? t.shape(i) >= 0 : true;",
        "tests": ["request_decode_test", "api_test"],
    },
    {
        "name": "nan-check-removed",
        "what": "validation: fp32 NaN/Inf values are no longer refused",
        "file": "server/service/request_decode.cc",
        "old": '        if ((bits & 0x7F800000u) == 0x7F800000u) return bad(i, "NaN or Inf");',
        "new": "",
        "tests": ["request_decode_test", "api_test"],
    },
    {
        "name": "length-moves-on-failed-step",
        "what": "commit: a step that failed on a rank still moves the sequences' lengths",
        "file": "server/exec/executor.cc",
        "old": """    spdlog::debug("step {}: layer {} failed: {}", step.step_id, step.layer, status.ToString());
    return status;""",
        "new": """    spdlog::debug("step {}: layer {} failed: {}", step.step_id, step.layer, status.ToString());
    for (int32_t i = 0; i < num_requests; ++i) seqs[i]->caches[pool].length = lengths[i];
    return status;""",
        "tests": ["executor_state_test"],
    },
    {
        "name": "partial-append-on-error",
        "what": "plan: a step refused at sequence i (past max_context) keeps the earlier sequences' new lengths",
        "file": "server/exec/planner.cc",
        "old": """    if (L > p.max_context) {
      return absl::OutOfRangeError(""",
        "new": """    if (L > p.max_context) {
      for (int32_t j = 0; j < i; ++j) seqs[j]->caches[pool].length = lengths[j];
      return absl::OutOfRangeError(""",
        "tests": ["executor_state_test"],
    },
    {
        "name": "columnar-keys-not-offset",
        "what": "columnar step: every request's new keys are read from the stacked tensor's start",
        "file": "server/service/request_decode.cc",
        "old": "        in.new_keys.keys = base + at * row_bytes;",
        "new": "        in.new_keys.keys = base;",
        "tests": ["request_decode_test", "columnar_test"],
    },
    {
        "name": "columnar-position-dropped",
        "what": "columnar step: new_keys_positions are ignored (the keys append)",
        "file": "server/service/request_decode.cc",
        "old": "      if (p >= 0) in.new_keys.position = p;",
        "new": "",
        "tests": ["request_decode_test", "columnar_test"],
    },
]
