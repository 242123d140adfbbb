// decode-indexer-load: drives a decode-indexer server the way a serving frontend does and
// reports throughput, latency percentiles, errors and where the time went.
//
//   decode-indexer-load --target 127.0.0.1:50051 --concurrency 8 --requests-per-step 8
//       --context 8192 --duration 30 --json report.json
//
// Exit status: 0 on a clean run; 1 when an RPC failed (unless --allow-errors) or --verify
// found a wrong answer; 2 on a usage error; 3 when the run could not take place.
#include <unistd.h>

#include <cstdio>
#include <string>

#include "CLI/CLI.hpp"
#include "client/load/runner.h"
#include "common/cli.h"

int main(int argc, char** argv) {
  using decode_indexer::load::LoadOptions;
  using decode_indexer::load::PayloadFormat;
  LoadOptions o;
  std::string json_path, csv_path, q_format = "quantized", key_format = "quantized";
  std::string arrival = "constant", progress = "auto", answer_encoding = "raw";
  bool allow_errors = false, quiet = false;

  CLI::App app{"Load tester for decode-indexer: a serving frontend's decode traffic."};
  app.add_option("--target", o.channel.target, "server address host:port")->capture_default_str();
  app.add_option("--channels", o.channels, "gRPC connections (workers spread over them)")
      ->capture_default_str();
  app.add_option("--concurrency,-c", o.concurrency,
                 "workers: closed loop steps in flight / open loop most in flight")
      ->capture_default_str();
  app.add_option("--rate", o.rate, "open loop: token steps per second (0: closed loop)")
      ->capture_default_str();
  app.add_option("--arrival", arrival, "open loop arrivals: constant or poisson")
      ->check(CLI::IsMember({"constant", "poisson"}))
      ->capture_default_str();
  auto* duration = app.add_option("--duration", o.duration_s, "measured seconds");
  auto* steps = app.add_option("--steps", o.steps, "measured token steps (all workers)");
  duration->excludes(steps);
  app.add_option("--warmup-steps", o.warmup_steps,
                 "token steps discarded first (default: one per worker)");
  app.add_flag("--streaming", o.streaming, "DecodeStream per worker instead of unary calls");
  app.add_flag("--columnar", o.columnar,
               "steps in the columnar form (packed sequence_ids, one stacked new_keys tensor) "
               "instead of a SequenceStep per request");
  app.add_option("--backoff-initial-ms", o.backoff_initial_ms,
                 "after a failed token step a worker waits this long (doubling with each "
                 "failure in a row, jittered to 50-100%; 0: no backoff)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--backoff-max-ms", o.backoff_max_ms, "longest wait after failures")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--deadline", o.deadline_ms,
                 "deadline in ms (0: none): per RPC (unary), per step (--streaming: the "
                 "step's timeout_us)")
      ->capture_default_str();
  app.add_option("--answer-encoding", answer_encoding,
                 "how answers come back: raw (int32) or delta (varint gaps)")
      ->check(CLI::IsMember({"raw", "delta"}))
      ->capture_default_str();
  app.add_flag("--shared-memory", o.shared_memory,
               "q, weights and answers through a POSIX shm region per worker (server on this "
               "host)");
  app.add_flag("--fast-path", o.fast_path,
               "steps through a step ring in shared memory per worker (no gRPC per step; "
               "server on this host with --shm-socket; implies --columnar)");
  app.add_option("--requests-per-step", o.requests_per_step,
                 "sequences (requests) in each DecodeStep")
      ->capture_default_str();
  app.add_option("--next-n", o.next_n, "rows per request (1 + speculative tokens)")
      ->capture_default_str();
  app.add_option("--draft-reject", o.draft_reject,
                 "speculative mode: probability that a draft token (rows 2..next-n) is "
                 "rejected; the next step writes at the accepted position, rolling the rest "
                 "back (0: off)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--context", o.context, "mean prefill length in cache entries")
      ->capture_default_str();
  app.add_option("--context-spread", o.context_spread,
                 "prefill lengths uniform in (1 +- spread) x context")
      ->capture_default_str();
  app.add_option("--max-layers", o.max_layers, "run only the first N layers of the plan")
      ->capture_default_str();
  app.add_option("--q-format", q_format, "q payload: quantized (codes+weights) or fp32")
      ->check(CLI::IsMember({"quantized", "fp32"}))
      ->capture_default_str();
  app.add_option("--key-format", key_format, "key payload: quantized or fp32")
      ->check(CLI::IsMember({"quantized", "fp32"}))
      ->capture_default_str();
  app.add_flag("--positions", o.positions, "send positions (server applies RoPE)");
  app.add_option("--prefill-chunk", o.prefill_chunk, "keys per AppendKeys call")
      ->capture_default_str();
  app.add_option("--seed", o.seed, "random seed (0: from the clock)");
  app.add_option("--sequence-id-base", o.sequence_id_base, "first sequence id (0: random)");
  app.add_flag("--keep-sequences", o.keep_sequences, "do not release the sequences at the end");
  app.add_flag("--verify", o.verify,
               "check sampled answers against the independent reference (di_reference)");
  app.add_option("--verify-sequences", o.verify_sequences, "sequences checked by --verify")
      ->capture_default_str();
  app.add_option("--verify-every", o.verify_every, "check every n-th token step")
      ->capture_default_str();
  app.add_option("--verify-tolerance", o.verify_tolerance,
                 "near-tie slack relative to the K-th logit (0: exact answers only)")
      ->capture_default_str();
  app.add_option("--json", json_path, "write the JSON report here (- for stdout)");
  app.add_option("--csv", csv_path,
                 "append a one-row CSV report here, one row per run (header once; - for stdout)");
  app.add_option("--progress", progress, "live progress line: auto (on a TTY), on, off")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  app.add_flag("--allow-errors", allow_errors, "exit 0 even when RPCs failed");
  app.add_flag("-q,--quiet", quiet, "no text report on stdout");
  app.add_option("--tls-ca", o.channel.tls_ca, "CA certificate (PEM): use TLS");
  app.add_option("--tls-cert", o.channel.tls_cert, "client certificate (PEM): mutual TLS");
  app.add_option("--tls-key", o.channel.tls_key, "client key (PEM): mutual TLS");
  app.add_option("--tls-server-name", o.channel.tls_server_name,
                 "name checked in the server certificate");
  app.add_option("--token", o.channel.bearer_token, "bearer token for every call");
  decode_indexer::cli::AddVersion(app);
  DI_CLI_PARSE(app, argc, argv);
  if (o.steps == 0 && o.duration_s == 0) o.duration_s = 10;
  o.poisson = arrival == "poisson";
  o.answer_encoding = answer_encoding == "delta" ? decode_indexer::v1::ANSWER_ENCODING_DELTA_VARINT
                                                 : decode_indexer::v1::ANSWER_ENCODING_RAW;
  o.q_format = q_format == "fp32" ? PayloadFormat::kFp32 : PayloadFormat::kQuantized;
  o.key_format = key_format == "fp32" ? PayloadFormat::kFp32 : PayloadFormat::kQuantized;
  o.progress = progress == "on" || (progress == "auto" && isatty(STDERR_FILENO));

  auto report = decode_indexer::load::RunLoad(o);
  if (!report.ok()) {
    std::fprintf(stderr, "decode-indexer-load: %s\n", report.status().ToString().c_str());
    return report.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 3;
  }
  if (!quiet) std::fputs(report->ToText().c_str(), stdout);
  if (!json_path.empty()) {
    if (auto s = decode_indexer::load::WriteOutput(json_path, report->ToJson().dump(2) + "\n");
        !s.ok()) {
      std::fprintf(stderr, "decode-indexer-load: %s\n", s.ToString().c_str());
      return 3;
    }
  }
  if (!csv_path.empty()) {
    if (auto s = decode_indexer::load::AppendCsv(csv_path, report->ToCsv()); !s.ok()) {
      std::fprintf(stderr, "decode-indexer-load: %s\n", s.ToString().c_str());
      return 3;
    }
  }
  const auto& v = report->verify;
  if (v.rows_mismatched > 0 || v.candidate_rows_mismatched > 0) return 1;
  if (v.enabled && v.rows_checked == 0) {
    std::fprintf(stderr, "decode-indexer-load: --verify checked no rows\n");
    return 1;
  }
  if (!allow_errors && report->samples.rpcs_failed > 0) return 1;
  return 0;
}
