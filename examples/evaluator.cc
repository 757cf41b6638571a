// evaluator: follows a training job's checkpoints and reports the model's
// test accuracy and loss at each, without any worker (it rebuilds the
// whole model from the owner files, checkpoint/checkpoint.h).
//
//   master --workers w1,w2 --dataset fashion-mnist --checkpoint-dir /ckpt --checkpoint-every 200 &
//   evaluator --checkpoint-dir /ckpt --dataset fashion-mnist
//
// It waits for new checkpoints (polling the directory), evaluates each on
// the test set, prints a line and appends a JSON line to --output; it
// exits after the run's final checkpoint, on SIGINT/SIGTERM (after the
// evaluation under way), after --timeout seconds without a new checkpoint,
// or with --once after the latest one. A checkpoint --output holds a score
// of (on the same test images) is not evaluated again: a restarted
// evaluator goes on where the last one stopped.
//
// A language model's run (--dataset text:PATH) is scored on the text's
// held-out tail, windows of the training's --seq-len read with its
// --tokenizer (both taken from the checkpoint): the mean cross-entropy of
// a next token, its perplexity, and how often the next token is first
// (and among the first five).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ops/any.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/eq.h>
#include <c10/core/GradMode.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/json.h"
#include "base/numbers.h"
#include "base/status_util.h"
#include "checkpoint/checkpoint.h"
#include "data/datasets.h"
#include "data/imagefolder.h"
#include "data/text.h"
#include "examples/stock_worker.h"
#include "pipeline/accuracy.h"
#include "shards/stage_types.h"
#include "launch/cli.h"
#include "launch/error_text.h"
#include "launch/worker_main.h"
#include "runtime/threads.h"

namespace remora {
namespace {

std::atomic<bool> g_stop{false};

void OnSignal(int) { g_stop = true; }

struct Score {
  double accuracy = 0, loss = 0;
  double top5 = 0;  // a label among the five highest logits (with fewer than 5 classes: 1)
  int64_t skipped = 0;  // test images left out as unreadable (--skip-bad-images)
  bool tokens = false;  // a language model's: the figures are a next token's
};

// Accuracy, top-5 accuracy and mean cross-entropy of `model` (stages
// applied in turn) on the first `rows` rows of `set`; `text`: the rows are
// a language model's windows (for the hint on a failure).
absl::StatusOr<Score> Evaluate(std::vector<std::unique_ptr<pipeline::StageModule>>& model,
                               const data::Source& set, int64_t rows, int64_t batch_size, bool text) {
  c10::NoGradGuard no_grad;
  pipeline::Correct right;
  double loss_sum = 0;
  int64_t skipped = 0;
  try {
    for (int64_t at = 0; at < rows; at += batch_size) {
      const int64_t end = std::min(rows, at + batch_size);
      ASSIGN_OR_RETURN(data::Batch batch, set.Get(at::arange(at, end, at::kLong), /*epoch=*/0));
      skipped += batch.skipped;
      const int64_t n = batch.labels.size(0);
      if (n == 0) continue;  // every file of it skipped
      c10::IValue x = batch.images;
      for (auto& stage : model) x = stage->Forward(x);
      const at::Tensor logits = x.toTensor().cpu();
      const at::Tensor& labels = batch.labels;
      if (labels.dim() == 2) {  // a language model's next tokens: [windows, T] against [windows, T, vocab]
        ASSIGN_OR_RETURN(pipeline::Correct counted, pipeline::CountCorrect(logits, labels));
        right += counted;
        loss_sum += counted.loss_sum;
        continue;
      }
      if (logits.dim() != 2 || logits.size(0) != n) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "the model's output for %d images has shape %s; the evaluator wants [%d, classes] (is --dataset "
            "the training's?)", n, c10::str(logits.sizes()), n));
      }
      ASSIGN_OR_RETURN(pipeline::Correct counted, pipeline::CountCorrect(logits, labels));
      right += counted;
      loss_sum += at::cross_entropy_loss(logits, labels).item<double>() * n;
    }
  } catch (...) {
    return base::StatusFromCurrentException(text ? "evaluating the model (is --dataset the training's, and --seq-len?)"
                                           : "evaluating the model (is --dataset the training's, and --image-size?)");
  }
  if (right.rows == 0) return absl::InvalidArgumentError("evaluating the model: no test image could be read");
  return Score{right.accuracy(), base::UnsignedNan(loss_sum / right.counted()), right.top5_accuracy(), skipped,
               right.items > 0};
}

// The flags.
struct Options {
  std::string dir, dataset, output;
  // (--image-size: master's default.)
  int poll_ms = 500, timeout_s = 0, batch_size = 1000, test_rows = 0, image_size = 128, data_threads = 4;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  double val_fraction = 0;
  bool once = false, skip_bad_images = false;
  bool verbose = false;  // TorchScript's interpreter traceback in errors
  // A text's (master's defaults, unless the checkpoint records others).
  int seq_len = 64;
  std::string tokenizer;
};

bool ImageFolder(const Options& o) { return o.dataset.rfind("imagefolder:", 0) == 0; }
bool Text(const Options& o) { return o.dataset.rfind("text:", 0) == 0; }

// The value of `key` that the run which wrote `m` recorded in its model or
// data identity ("image-size=128"), or nullopt.
std::optional<std::string> Recorded(const checkpoint::Manifest& m, absl::string_view key) {
  for (const std::string* field : {&m.model, &m.data}) {
    for (absl::string_view token : absl::StrSplit(*field, ' ')) {
      if (absl::ConsumePrefix(&token, key) && absl::ConsumePrefix(&token, "=")) return std::string(token);
    }
  }
  return std::nullopt;
}

// Whether the run that wrote `m` trained on `dataset` (an absolute name).
bool TrainedOn(const checkpoint::Manifest& m, const std::string& dataset) {
  return data::AbsoluteDatasetName(m.data.substr(0, m.data.find(' '))) == dataset;
}

// An image folder's checkpoint `ck` against the evaluator's settings: an
// error when its run held out another fraction of the folder (the scores
// would take in images it trained on, or leave test images out); a note,
// once (`*noted`), when it trained at another image size (scoring at
// another size can be meant).
absl::Status CheckTrainedAs(const checkpoint::Checkpoint& ck, const Options& o, bool* noted) {
  if (Text(o)) {
    if (!TrainedOn(ck.manifest, o.dataset)) return absl::OkStatus();
    int seq_len = 0;
    if (auto v = Recorded(ck.manifest, "seq-len"); v && absl::SimpleAtoi(*v, &seq_len) && seq_len != o.seq_len) {
      return absl::FailedPreconditionError(absl::StrCat(ck.dir, " was trained on windows of ", seq_len,
                                                        " tokens; the evaluator's --seq-len is ", o.seq_len,
                                                        ": leave --seq-len out (the training's is taken)"));
    }
    if (const std::string t = Recorded(ck.manifest, "tokenizer").value_or(""); t != o.tokenizer) {
      return absl::FailedPreconditionError(absl::StrCat(
          ck.dir, " was trained on ", t.empty() ? std::string("bytes") : absl::StrCat("--tokenizer ", t),
          "; the evaluator reads ", o.tokenizer.empty() ? std::string("bytes") : o.tokenizer,
          ": leave --tokenizer out (the training's is taken)"));
    }
    double held = 0;
    if (auto v = Recorded(ck.manifest, "val-fraction"); v && !absl::SimpleAtod(*v, &held)) held = -1;
    if (std::abs(held - o.val_fraction) > 1e-9) {
      return absl::FailedPreconditionError(absl::StrCat(
          ck.dir, " held ", absl::StrCat(held), " of the text out (--val-fraction); the evaluator's is ",
          o.val_fraction, ", which scores other windows: leave --val-fraction out (the training's is taken)"));
    }
    return absl::OkStatus();
  }
  if (!ImageFolder(o)) return absl::OkStatus();
  // (No val-fraction recorded by a run on the folder: none held out.)
  double held = 0;
  if (auto v = Recorded(ck.manifest, "val-fraction"); v && !absl::SimpleAtod(*v, &held)) held = -1;
  if (TrainedOn(ck.manifest, o.dataset) && std::abs(held - o.val_fraction) > 1e-9) {
    if (held == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          ck.dir, " was trained on all of the folder's images (no --val-fraction): --val-fraction ", o.val_fraction,
          " would score images it trained on. Score a folder with a val/ folder, or another dataset"));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        ck.dir, " was trained with --val-fraction ", absl::StrCat(held), " of the folder held out; the evaluator's "
        "is ", o.val_fraction, ", which scores other images: give --val-fraction ", absl::StrCat(held),
        " (or leave it out: the training's is taken)"));
  }
  int size = 0;
  if (auto v = Recorded(ck.manifest, "image-size"); v && absl::SimpleAtoi(*v, &size) && size != o.image_size &&
                                                     !*noted) {
    std::printf("evaluator: note: %s was trained at --image-size %d; scoring at %d\n", ck.dir.c_str(), size,
                o.image_size);
    *noted = true;
  }
  return absl::OkStatus();
}

// The test set: in memory (held in `in_memory`), or an image folder's
// val/ (or the training images --val-fraction holds out) read as it is
// needed.
absl::StatusOr<std::unique_ptr<data::Source>> OpenTestSet(const Options& o, data::Dataset* in_memory) {
  if (Text(o)) {
    // (Its tokens in a file of the evaluator's own, in the temporary
    // directory: the job's beside its checkpoints may be written meanwhile.)
    const std::string path = o.dataset.substr(std::strlen("text:"));
    std::error_code ec;
    const std::filesystem::path tmp = std::filesystem::temp_directory_path(ec);
    const std::string cache =
        absl::StrCat(ec ? std::string("/tmp") : tmp.string(), "/remora-evaluator-",
                     std::hash<std::string>()(absl::StrCat(path, "\n", o.tokenizer)) % 1000000007, ".tokens");
    ASSIGN_OR_RETURN(std::shared_ptr<const data::TextCorpus> corpus, data::TextCorpus::Open(path, cache, o.tokenizer));
    auto windows = std::make_unique<data::TextWindows>(std::move(corpus),
                                                       data::TextWindowOptions{o.seq_len, o.val_fraction, 0},
                                                       /*train=*/false);
    RETURN_IF_ERROR(windows->Check());
    return std::unique_ptr<data::Source>(std::move(windows));
  }
  if (o.dataset.rfind("imagefolder:", 0) == 0) {
    data::ImageFolderOptions f;
    f.train = false;
    f.image_size = o.image_size;
    f.threads = o.data_threads;
    f.val_fraction = o.val_fraction;
    f.skip_bad_images = o.skip_bad_images;
    ASSIGN_OR_RETURN(auto folder, data::ImageFolder::Open(o.dataset.substr(std::strlen("imagefolder:")), "val", f));
    return std::unique_ptr<data::Source>(std::move(folder));
  }
  auto sets = data::LoadNamed(o.dataset);
  if (absl::IsNotFound(sets.status())) {
    // (A test set alone is not enough: it is normalised as training did.)
    return base::Annotate(sets.status(), "the evaluator reads the training images too, for the mean and deviation "
                                   "training normalised with");
  }
  if (!sets.ok()) return sets.status();
  *in_memory = std::move(sets->second);
  return std::unique_ptr<data::Source>(std::make_unique<data::InMemory>(*in_memory));
}

// The lines already in o.output (none when it is not there yet).
std::vector<std::string> ReadRecorded(const Options& o) {
  std::vector<std::string> lines;
  std::ifstream in(o.output);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The identity of a checkpoint's score in o.output: the checkpoint (its
// step, its manifest's time, final or not) and the test images.
std::vector<std::pair<std::string, std::string>> ScoreKey(const checkpoint::Checkpoint& ck, const Options& o,
                                                          int64_t rows) {
  const auto& m = ck.manifest;
  std::vector<std::pair<std::string, std::string>> key = {{"step", absl::StrCat(m.step)},
                                                          {"created", base::JsonQuoted(m.created)},
                                                          {"final", m.final ? "true" : "false"},
                                                          {"dataset", base::JsonQuoted(o.dataset)},
                                                          {"test_images", absl::StrCat(rows)}};
  if (ImageFolder(o)) {  // (what the crops and the held-out images depend on)
    key.emplace_back("image_size", absl::StrCat(o.image_size));
    key.emplace_back("val_fraction", base::JsonGeneral(o.val_fraction));
  }
  if (Text(o)) {  // (what the held-out windows are)
    key.emplace_back("seq_len", absl::StrCat(o.seq_len));
    key.emplace_back("val_fraction", base::JsonGeneral(o.val_fraction));
    key.emplace_back("tokenizer", base::JsonQuoted(o.tokenizer));
  }
  return key;
}

// The score `recorded` (o.output's lines) holds for `ck` already: a
// restarted evaluator, or --once, does not append it twice.
std::optional<Score> FindRecorded(const std::vector<std::string>& recorded, const checkpoint::Checkpoint& ck,
                                  const Options& o, int64_t rows) {
  const auto key = ScoreKey(ck, o, rows);
  for (const std::string& line : recorded) {
    auto holds = [&line](const auto& kv) { return base::JsonValueText(line, kv.first) == kv.second; };
    if (std::all_of(key.begin(), key.end(), holds)) {
      return Score{base::JsonNumber(line, "test_accuracy"), base::JsonNumber(line, "test_loss"),
                   base::JsonNumber(line, "test_top5"), 0, Text(o)};
    }
  }
  return std::nullopt;
}

// A checkpoint's score: a line on the output and, unless `known` (o.output
// holds it already), a JSON line appended to o.output (and to `recorded`).
absl::Status Record(const checkpoint::Checkpoint& ck, const Score& score, bool known, const Options& o,
                    int64_t rows, std::vector<std::string>* recorded) {
  const auto& m = ck.manifest;
  std::printf("step=%lld epoch=%d test_accuracy=%.4f test_top5=%.4f test_loss=%.4f%s%s%s%s\n",
              static_cast<long long>(m.step), m.epoch, score.accuracy, score.top5, score.loss,
              score.tokens ? absl::StrFormat(" test_perplexity=%.3f", std::exp(score.loss)).c_str() : "",
              score.skipped > 0 ? absl::StrCat(" skipped_images=", score.skipped).c_str() : "",
              m.final ? " (final)" : "", known ? absl::StrCat(" (in ", o.output, " already)").c_str() : "");
  std::fflush(stdout);
  if (known) return absl::OkStatus();
  // (A loss that is not finite, a model that diverged, is null: JSON has
  // no NaN.)
  std::string line = absl::StrFormat(
      "{\"step\": %d, \"epoch\": %d, \"batch\": %d, \"test_accuracy\": %s, \"test_top5\": %s, "
      "\"test_loss\": %s, \"final\": %s, \"checkpoint\": %s, \"created\": %s, \"dataset\": %s, "
      "\"test_images\": %d%s%s%s}",
      m.step, m.epoch, m.batch, base::JsonFixed(6, score.accuracy), base::JsonFixed(6, score.top5),
      base::JsonFixed(6, score.loss), m.final ? "true" : "false", base::JsonQuoted(ck.dir), base::JsonQuoted(m.created),
      base::JsonQuoted(o.dataset), rows,
      ImageFolder(o) ? absl::StrFormat(", \"image_size\": %d, \"val_fraction\": %s", o.image_size,
                                       base::JsonGeneral(o.val_fraction))
                     : "",
      Text(o) ? absl::StrFormat(", \"test_perplexity\": %s, \"seq_len\": %d, \"val_fraction\": %s, \"tokenizer\": %s",
                                base::JsonFixed(6, std::exp(score.loss)), o.seq_len, base::JsonGeneral(o.val_fraction),
                                base::JsonQuoted(o.tokenizer))
              : "",
      score.skipped > 0 ? absl::StrCat(", \"skipped_images\": ", score.skipped) : "");
  std::ofstream out(o.output, std::ios::app);
  out << line << "\n" << std::flush;
  if (!out) return absl::InternalError("cannot append to " + o.output);
  recorded->push_back(std::move(line));
  return absl::OkStatus();
}

// Follows o.dir: evaluates each new checkpoint on the first `rows` of
// `test` until the final one (or one: with --once, or given one
// checkpoint's directory); returns the exit code.
int Follow(const Options& o, const data::Source& test, int64_t rows) {
  auto fail = [&o](const std::string& msg, int rc) {
    std::cerr << "evaluator: " << (o.verbose ? msg : launch::WithoutTorchScriptTraceback(msg)) << "\n";
    return rc;
  };
  // One checkpoint's directory (not the job's) gets no newer one: it is
  // evaluated once, as with --once.
  const bool once = o.once || checkpoint::IsCheckpointDir(o.dir);
  // The last checkpoint evaluated, and its score (the run's final
  // checkpoint may be the last periodic one, committed again as final).
  std::string done;
  Score done_score;
  auto last_new = std::chrono::steady_clock::now();
  bool warned = false;
  std::set<std::string> passed_over;  // newer checkpoints that could not be read, said once
  std::vector<std::string> recorded = ReadRecorded(o);
  bool noted_size = false;
  while (!g_stop) {
    auto ck = checkpoint::Latest(o.dir);
    for (const std::string& skipped : ck.ok() ? ck->passed_over : std::vector<std::string>{}) {
      if (passed_over.insert(skipped).second) {
        std::printf("evaluator: warning: a newer checkpoint cannot be read (%s); skipped\n", skipped.c_str());
      }
    }
    const bool again = ck.ok() && ck->dir == done;
    if (ck.ok() && (!again || ck->manifest.final)) {
      // Scored before (by this evaluator, or by one that ran before it):
      // not loaded and evaluated again.
      // (The final commit of the checkpoint scored last is a line of its own.)
      if (absl::Status s = CheckTrainedAs(*ck, o, &noted_size); !s.ok()) return fail(std::string(s.message()), 1);
      const std::optional<Score> known = FindRecorded(recorded, *ck, o, rows);
      const bool skip = again || known.has_value();
      auto model = skip ? absl::StatusOr<std::vector<std::unique_ptr<pipeline::StageModule>>>()
                        : checkpoint::LoadModel(*ck, c10::kCPU);
      auto score = known   ? absl::StatusOr<Score>(*known)
                   : again ? absl::StatusOr<Score>(done_score)
                   : model.ok() ? Evaluate(*model, test, rows, o.batch_size, Text(o))
                                : absl::StatusOr<Score>(model.status());
      if (!skip && model.ok() && !score.ok()) {
        score = base::Annotate(score.status(), absl::StrCat("the model of ", ck->dir, " on ", o.dataset,
                                                      Text(o) ? "'s held-out windows" : "'s test images"));
      }
      if (!score.ok()) {
        if (once || std::filesystem::exists(ck->manifest_path)) return fail(std::string(score.status().message()), 1);
        // Pruned while it was read (--keep): a newer one is there.
      } else {
        if (auto s = Record(*ck, *score, known.has_value(), o, rows, &recorded); !s.ok()) {
          return fail(std::string(s.message()), 1);
        }
        done = ck->dir;
        done_score = *score;
        last_new = std::chrono::steady_clock::now();
        if (ck->manifest.final || once) return 0;
      }
    } else if (!ck.ok()) {
      if (once) return fail(std::string(ck.status().message()), 1);
      if (ck.status().code() != absl::StatusCode::kNotFound) return fail(std::string(ck.status().message()), 1);
      if (!warned) {
        std::printf("evaluator: no checkpoint yet in %s; waiting\n", o.dir.c_str());
        std::fflush(stdout);
        warned = true;
      }
    }
    if (o.timeout_s > 0 && std::chrono::steady_clock::now() - last_new > std::chrono::seconds(o.timeout_s)) {
      return fail(absl::StrFormat("no new checkpoint in %s for %d s (--timeout)", o.dir, o.timeout_s), 3);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(o.poll_ms));
  }
  std::printf("evaluator: stopped\n");
  return 0;
}

int Main(int argc, char** argv) {
  Options o;
  launch::FlagParser flags("evaluator",
                        "Follows a training job's checkpoints: evaluates each new one on the test set "
                        "(no workers needed) and appends its accuracy and loss to a JSON-lines file; a language "
                        "model's (text:PATH) on the text's held-out tail, with its perplexity.");
  flags.JoinsNoGroup();
  flags.AddString("checkpoint-dir", &o.dir, "the job's --checkpoint-dir (required)");
  flags.AddString("dataset", &o.dataset,
                  "fashion-mnist, idx:DIR, cifar10:DIR or imagefolder:DIR (its val/ folder, or what "
                  "--val-fraction holds out), or text:PATH (the tail --val-fraction holds out): the test set "
                  "(required)");
  flags.AddInt("seq-len", &o.seq_len,
               "with text:PATH: tokens a window (default: the training's, read from the checkpoint)");
  flags.AddString("tokenizer", &o.tokenizer,
                  "with text:PATH: the SentencePiece model the text is read with (default: the training's, read "
                  "from the checkpoint; none: bytes)");
  flags.AddInt("image-size", &o.image_size,
               "with imagefolder: the size of the centre crops scored (default: the training's, read from the "
               "checkpoint, else master's default)");
  flags.AddBool("skip-bad-images", &o.skip_bad_images,
                "with imagefolder: leave test images that cannot be read out of the score (counted)");
  flags.AddInt("data-threads", &o.data_threads, "with imagefolder: decoding threads");
  flags.AddDouble("val-fraction", &o.val_fraction,
                  "with imagefolder and no val/ folder: the fraction of the folder scored, the images training "
                  "held out; with text:PATH, the text's tail scored (default: the training's, read from the "
                  "checkpoint)");
  flags.AddString("output", &o.output,
                  "JSON-lines file to append to (default: CHECKPOINT_DIR/eval.jsonl; given one checkpoint's "
                  "directory, the job's eval.jsonl beside it)");
  flags.AddInt("poll-ms", &o.poll_ms, "how often to look for a new checkpoint");
  flags.AddInt("timeout", &o.timeout_s, "exit (status 3) after this many seconds without a new checkpoint; 0: wait");
  flags.AddBool("once", &o.once, "evaluate the latest checkpoint and exit");
  flags.AddInt("batch-size", &o.batch_size, "test images per forward pass");
  flags.AddInt("test-rows", &o.test_rows, "evaluate the first N test images only (0: all)");
  flags.AddInt("threads", &o.threads, "intra-op threads");
  flags.AddBool("verbose", &o.verbose,
                "print a TorchScript error whole, with the interpreter's traceback (without: PyTorch's message and "
                "the line it failed at)");
  int code = 0;
  if (!flags.Parse(argc, argv, &code)) return code;
  auto fail = [&o](const std::string& msg, int rc) {
    std::cerr << "evaluator: " << (o.verbose ? msg : launch::WithoutTorchScriptTraceback(msg)) << "\n";
    return rc;
  };
  if (o.dir.empty() || o.dataset.empty()) return fail("--checkpoint-dir and --dataset are required", 2);
  if (auto s = launch::CheckAtLeast({{"poll-ms", o.poll_ms, 1},
                                     {"batch-size", o.batch_size, 1},
                                     {"threads", o.threads, 1},
                                     {"timeout", o.timeout_s, 0},
                                     {"test-rows", o.test_rows, 0},
                                     {"image-size", o.image_size, 16},
                                     {"data-threads", o.data_threads, 1}});
      !s.ok()) {
    return fail(std::string(s.message()), 2);
  }
  if (o.threads > launch::kMaxThreads) {
    return fail(absl::StrCat("--threads must be at most ", launch::kMaxThreads, "; got ", o.threads), 2);
  }
  if (auto s = data::CheckDatasetName(o.dataset); !s.ok()) return fail(std::string(s.message()), 2);
  o.dataset = data::AbsoluteDatasetName(o.dataset);
  if (!(o.val_fraction >= 0 && o.val_fraction < 1)) return fail("--val-fraction must be in [0, 1)", 2);
  if (o.val_fraction > 0 && !ImageFolder(o) && !Text(o)) {
    return fail("--val-fraction is for --dataset imagefolder:DIR or text:PATH (the training's held-out part)", 2);
  }
  if (!Text(o)) {
    std::vector<std::string> unused;
    for (const char* f : {"seq-len", "tokenizer"}) {
      if (flags.given().count(f)) unused.push_back(absl::StrCat("--", f));
    }
    if (!unused.empty()) {
      std::printf("evaluator: note: %s without --dataset text:PATH (no effect)\n", absl::StrJoin(unused, ", ").c_str());
    }
  }
  if (Text(o)) {
    // The training's windows, held-out tail and tokens, where a checkpoint
    // is there already and the flags leave them out; else master's
    // defaults.
    if (!flags.given().count("val-fraction")) o.val_fraction = 0.05;
    if (auto ck = checkpoint::Latest(o.dir); ck.ok() && TrainedOn(ck->manifest, o.dataset)) {
      std::vector<std::string> taken;
      int seq_len = 0;
      double held = 0;
      if (auto v = Recorded(ck->manifest, "seq-len"); v && absl::SimpleAtoi(*v, &seq_len) &&
                                                      !flags.given().count("seq-len")) {
        o.seq_len = seq_len;
        taken.push_back(absl::StrCat("--seq-len ", seq_len));
      }
      if (!flags.given().count("val-fraction")) {
        auto v = Recorded(ck->manifest, "val-fraction");
        o.val_fraction = v && absl::SimpleAtod(*v, &held) ? held : 0;
        taken.push_back(absl::StrCat("--val-fraction ", v.value_or("0")));
      }
      if (auto v = Recorded(ck->manifest, "tokenizer"); v && !flags.given().count("tokenizer")) {
        o.tokenizer = *v;
        taken.push_back(absl::StrCat("--tokenizer ", *v));
      }
      if (!taken.empty()) {
        std::printf("evaluator: %s, the training's (%s)\n", absl::StrJoin(taken, " ").c_str(),
                    ck->manifest_path.c_str());
      }
    }
    if (o.seq_len < 1) return fail("--seq-len must be 1 or more", 2);
    if (o.val_fraction <= 0) {
      return fail("a text's test set is its held-out tail: the run held none out (--val-fraction 0); give "
                  "--val-fraction F to score the text's last F anyway",
                  2);
    }
  } else if (ImageFolder(o)) {
    // The training's crop size and held-out fraction, where a checkpoint
    // is there already and the flags leave them out.
    if (auto ck = checkpoint::Latest(o.dir); ck.ok()) {
      std::vector<std::string> taken;
      int size = 0;
      double held = 0;
      if (auto v = Recorded(ck->manifest, "image-size"); v && absl::SimpleAtoi(*v, &size) &&
                                                         !flags.given().count("image-size")) {
        o.image_size = size;
        taken.push_back(absl::StrCat("--image-size ", size));
      }
      if (auto v = Recorded(ck->manifest, "val-fraction"); v && absl::SimpleAtod(*v, &held) &&
                                                           !flags.given().count("val-fraction") &&
                                                           TrainedOn(ck->manifest, o.dataset)) {
        o.val_fraction = held;
        taken.push_back(absl::StrCat("--val-fraction ", *v));
      }
      if (!taken.empty()) {
        std::printf("evaluator: %s, the training's (%s)\n", absl::StrJoin(taken, " ").c_str(),
                    ck->manifest_path.c_str());
      }
    }
  }
  if (!ImageFolder(o)) {
    std::vector<std::string> unused;
    for (const char* f : {"image-size", "data-threads", "skip-bad-images"}) {
      if (flags.given().count(f)) unused.push_back(absl::StrCat("--", f));
    }
    if (!unused.empty()) {
      std::printf("evaluator: note: %s with %s: for imagefolder:DIR (no effect)\n", absl::StrJoin(unused, ", ").c_str(),
                  Text(o) ? "--dataset text:PATH" : "an in-memory --dataset");
    }
  }
  if (auto s = data::CheckDatasetDir(o.dataset, o.val_fraction); !s.ok()) return fail(std::string(s.message()), 2);
  if (std::error_code ec; std::filesystem::exists(o.dir, ec) && !std::filesystem::is_directory(o.dir, ec)) {
    return fail(absl::StrCat("--checkpoint-dir ", o.dir,
                             " is not a directory: give the job's checkpoint directory (or one checkpoint's)"), 2);
  }
  // (Given one checkpoint's directory, the job's: its scores stay with the
  // job's, and no later pruning of that checkpoint takes them along.)
  if (o.output.empty()) {
    std::filesystem::path job = std::filesystem::path(o.dir).lexically_normal();
    if (!job.has_filename()) job = job.parent_path();  // (a trailing slash)
    if (checkpoint::IsCheckpointDir(o.dir)) job = job.parent_path();
    o.output = (job.empty() ? std::filesystem::path(".") : job).string() + "/eval.jsonl";
  }
  // An --output that cannot be written fails now, not after the first
  // evaluation; its directory may not exist yet where it is the checkpoint
  // directory, which the job makes.
  const std::filesystem::path parent = std::filesystem::path(o.output).parent_path();
  const bool job_makes_it = parent == std::filesystem::path(o.dir) && !std::filesystem::exists(o.dir);
  if (const std::string why = job_makes_it ? "" : launch::WhyCannotWrite(o.output); !why.empty()) {
    return fail(absl::StrCat("cannot write --output ", o.output, " (", why, "): give a file this user can write"), 2);
  }
  if (std::error_code ec; o.once && !std::filesystem::exists(o.dir, ec)) {
    return fail(absl::StrCat("--checkpoint-dir ", o.dir, " does not exist: --once evaluates a checkpoint that is "
                             "there (without --once, the evaluator waits for the job to make it)"),
                2);
  }
  // (Several threads sleep while they wait, not spin, beside a training
  // job: this may start the program again, before anything is opened.)
  if (o.threads > 1) runtime::PreferSleepingComputeWaits(argv);
  runtime::SetComputeThreads(o.threads);
  if (auto s = shards::RegisterStageTypes(); !s.ok()) return fail(std::string(s.message()), 1);
  data::Dataset in_memory;
  auto test = OpenTestSet(o, &in_memory);
  if (!test.ok()) return fail(std::string(test.status().message()), 1);
  const int64_t rows = o.test_rows > 0 ? std::min<int64_t>(o.test_rows, (*test)->size()) : (*test)->size();
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  std::printf("evaluator: following %s, %lld %s of %s; results to %s\n", o.dir.c_str(),
              static_cast<long long>(rows), Text(o) ? "held-out windows" : "test images", o.dataset.c_str(),
              o.output.c_str());
  std::fflush(stdout);
  return Follow(o, **test, rows);
}

}  // namespace
}  // namespace remora

int main(int argc, char** argv) { remora::launch::ExitProgram(remora::Main(argc, argv)); }
