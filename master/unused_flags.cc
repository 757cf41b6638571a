// master's note on flags given that the run does not use (master/flags.h,
// UnusedFlags): apart from the checks, which refuse what cannot run.
#include "master/flags.h"

#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace remora::master {

std::string UnusedFlags(const std::set<std::string>& given, const RunOptions& c) {
  std::vector<std::string> lines;
  auto unused = [&given, &lines](std::vector<std::string> flags, const std::string& why) {
    std::vector<std::string> named;
    for (const std::string& f : flags) {
      if (given.count(f)) named.push_back("--" + f);
    }
    if (!named.empty()) lines.push_back(absl::StrCat(absl::StrJoin(named, ", "), " ", why));
  };
  if (c.dataset.empty()) {
    unused({"epochs", "shuffle", "train-rows", "data-on", "data-threads", "prefetch", "skip-bad-images",
            "val-fraction"},
           "without --dataset: the demo trains --batches random batches");
  } else if (!ReadsImageFolder(c)) {
    unused({"image-size", "data-threads", "prefetch", "skip-bad-images"},
           ReadsText(c) ? "with --dataset text:PATH: they are for imagefolder:DIR"
                        : "with an in-memory --dataset: they are for imagefolder:DIR");
  }
  if (!ReadsText(c)) {
    unused({"layers", "d-model", "heads", "seq-len", "peak-tflops", "tie-embeddings"},
           "without --dataset text:PATH: they size the GPT");
  } else if (!TrainsGpt(c)) {
    unused({"layers", "d-model", "heads", "peak-tflops", "tie-embeddings"}, "with --model: they size the built-in GPT");
  }
  if (c.checkpoint_dir.empty()) {
    unused({"checkpoint-every", "keep", "checkpoint-background"}, "without --checkpoint-dir");
  }
  if (c.max_restarts == 0) unused({"rejoin-timeout"}, "without --max-restarts");
  if (!c.dataset.empty()) {
    unused({"batches"}, "with --dataset: an epoch is the dataset's batches (--epochs, --train-rows)");
  } else {
    unused({"eval-every"}, "without --dataset");
  }
  if (c.replicas <= 1) {
    unused({"zero", "bucket-mb", "overlap", "collective-timeout", "insecure-collectives"}, "without --replicas");
  }
  if (c.model.empty()) unused({"input-shape", "classes"}, "without --model");
  if (!c.model.empty() && c.dataset.empty()) {
    unused({"image-size"}, "with --model and random data: the inputs are of --input-shape");
  }
  if (c.optimizer != "adamw") unused({"weight-decay", "decay-all"}, "without --optimizer adamw");
  if (c.lr_schedule == "constant") unused({"min-lr", "decay-steps"}, "with --lr-schedule constant");
  if (c.optimizer == "adam" || c.optimizer == "adamw") {
    unused({"momentum"}, absl::StrCat("with --optimizer ", c.optimizer));
  } else if (c.dataset.empty() && c.model.empty()) {
    unused({"momentum"}, "with the ResNet50 demo: it trains with plain SGD");
  }
  if (c.local) {
    // (This process trains the whole model: nothing is cut.)
    unused({"workers", "spares", "replicas", "pipeline-stages", "schedule", "interleave", "partition", "split-at",
            "recompute", "busy-poll-us"},
           "with --local");
  } else if (c.schedule == "ps") {
    unused({"recompute"}, "with --mode ps: each worker runs the whole model's forward and backward at once");
  } else if (!c.split_at.empty()) {
    unused({"partition"}, "with --split-at: the split points given are the cut");
  } else if (!c.model.empty() && !c.sequential) {
    unused({"partition"}, "with --model stage files: they are the stages");
  }
  if (lines.empty()) return "";
  return absl::StrCat("master: note: ", absl::StrJoin(lines, "; "), " (no effect)");
}

}  // namespace remora::master
