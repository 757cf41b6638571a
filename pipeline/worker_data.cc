#include "pipeline/worker_data.h"

#include <atomic>
#include <map>
#include <stdexcept>
#include <utility>

#include <ATen/core/ivalue.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status_util.h"
#include "pipeline/protocol.h"

namespace remora::pipeline {
namespace {

// A source this process opened for a master, with its skipped rows.
struct Opened {
  std::unique_ptr<data::Source> source;
  std::atomic<int64_t> skipped{0};
};

// The process's opened sources, by (worker, id): a test may run several
// workers in one process. Entries are shared so that a read in flight
// keeps its source while the master closes it.
using Key = std::pair<std::string, int64_t>;
struct Table {
  absl::Mutex mu;
  std::map<Key, std::shared_ptr<Opened>> by_id ABSL_GUARDED_BY(mu);
};

Table& TheTable() {
  static Table* table = new Table;  // never destroyed
  return *table;
}

std::shared_ptr<Opened> Find(const std::string& worker, int64_t id) {
  Table& t = TheTable();
  absl::MutexLock lock(&t.mu);
  auto it = t.by_id.find(Key(worker, id));
  return it == t.by_id.end() ? nullptr : it->second;
}

// The open call for `spec`, and the spec it asks for.
OpenDataRequest OpenRequestFor(int64_t source, const data::SourceSpec& s) {
  OpenDataRequest r;
  r.source = source;
  r.dataset = s.dataset;
  r.train = s.train;
  r.rows = s.rows;
  r.image_size = s.image_size;
  r.threads = s.threads;
  r.seed = static_cast<int64_t>(s.seed);
  r.skip_bad_images = s.skip_bad_images;
  r.listing_cache = s.listing_cache;
  r.val_fraction = s.val_fraction;
  r.seq_len = s.seq_len;
  r.token_cache = s.token_cache;
  r.tokenizer = s.tokenizer;
  return r;
}

data::SourceSpec SpecOf(const OpenDataRequest& r) {
  data::SourceSpec s;
  s.dataset = r.dataset;
  s.train = r.train;
  s.rows = r.rows;
  s.image_size = r.image_size;
  s.threads = r.threads;
  s.seed = static_cast<uint64_t>(r.seed);
  s.skip_bad_images = r.skip_bad_images;
  s.listing_cache = r.listing_cache;
  s.val_fraction = r.val_fraction;
  s.seq_len = r.seq_len;
  s.token_cache = r.token_cache;
  s.tokenizer = r.tokenizer;
  return s;
}

// Ids differ between the sources of this process and, with the clock in
// them, between masters that one worker meets.
std::atomic<int64_t> next_id{(absl::ToUnixMicros(absl::Now()) & 0xffffffffff) << 16};

}  // namespace

c10::IValue ToIValue(const WorkerRows& r) {
  return rpc::EncodeTuple(WorkerRowsValue{WorkerRowsValue::kFunction, r.source, r.rows, r.epoch});
}

std::optional<WorkerRows> WorkerRowsFrom(const c10::IValue& v) {
  if (!v.isTuple()) return std::nullopt;
  const absl::StatusOr<WorkerRowsValue> r = rpc::DecodeTuple<WorkerRowsValue>(v);
  if (!r.ok() || r->tag != WorkerRowsValue::kFunction) return std::nullopt;
  return WorkerRows{r->source, r->rows, r->epoch};
}

absl::StatusOr<std::unique_ptr<WorkerData>> WorkerData::Open(rpc::Agent& agent, std::vector<std::string> workers,
                                                            const data::SourceSpec& spec, int64_t rows) {
  const int64_t id = next_id++;
  // Listing a large image folder takes a while on a cold disk.
  rpc::CallOptions slow;
  slow.timeout = absl::Minutes(30);
  std::vector<rpc::Future<c10::IValue>> opened;
  for (const std::string& w : workers) {
    opened.push_back(agent.rpc_async(w, OpenDataRequest::kFunction, rpc::EncodeCall(OpenRequestFor(id, spec)), slow));
  }
  // Owns the workers' sources from here: an error below closes them, once
  // every open has answered (a close must not overtake its open).
  std::unique_ptr<WorkerData> data(new WorkerData(agent, workers, id, rows));
  absl::Status first;
  for (size_t i = 0; i < workers.size(); ++i) {
    absl::StatusOr<c10::IValue> n = opened[i].wait();
    if (!first.ok()) continue;
    if (!n.ok()) {
      first = base::Annotate(n.status(), absl::StrCat("opening ", spec.dataset, " on worker '", workers[i],
                                                "', which reads the rows it trains on (give it the same files "
                                                "at the same path, or --data-on master)"));
    } else if (!n->isInt()) {
      first = absl::InternalError(absl::StrCat("worker '", workers[i], "' answered ", OpenDataRequest::kFunction,
                                               " with a ", n->tagKind(), ", not its rows"));
    } else if (n->toInt() != rows) {
      first = absl::FailedPreconditionError(absl::StrCat(
          "worker '", workers[i], "' finds ", n->toInt(), " rows in ", spec.dataset, " (",
          spec.train ? "training" : "test", " split) where the master finds ", rows,
          ": give every worker the same files, or let the master send the batches (--data-on master)"));
    }
  }
  if (!first.ok()) return first;
  return data;
}

WorkerData::~WorkerData() {
  // Not waited for: a worker that is gone must not hold the master up.
  for (const std::string& w : workers_) {
    if (!agent_.IsLost(w)) agent_.rpc_async(w, CloseDataRequest::kFunction, rpc::EncodeCall(CloseDataRequest{{id_}}));
  }
}

absl::StatusOr<int64_t> WorkerData::skipped(
    const std::function<bool(const std::string&, const absl::Status&)>& lost) const {
  int64_t total = 0;
  for (const std::string& w : workers_) {
    if (!agent_.IsLost(w)) {
      absl::StatusOr<c10::IValue> n =
          agent_.rpc_sync(w, DataSkippedRequest::kFunction, rpc::EncodeCall(DataSkippedRequest{id_}));
      if (n.ok() && !n->isInt()) {
        n = absl::InternalError(absl::StrCat("worker '", w, "' answered ", DataSkippedRequest::kFunction,
                                             " with a ", n->tagKind(), ", not a count"));
      }
      if (n.ok()) {
        last_skipped_[w] = n->toInt();
      } else if (!lost || !lost(w, n.status())) {
        return base::Annotate(n.status(), absl::StrCat("asking worker '", w, "' for its skipped images"));
      }
    }
    total += last_skipped_[w];
  }
  return total;
}

absl::StatusOr<data::Batch> ReadRows(const std::string& worker, int64_t source, const at::Tensor& rows,
                                     int epoch) {
  std::shared_ptr<Opened> opened = Find(worker, source);
  if (!opened) {
    return absl::NotFoundError(absl::StrCat("worker '", worker, "' has no data source ", source,
                                            " (the master opens it before the first step)"));
  }
  absl::StatusOr<data::Batch> batch = opened->source->Get(rows, epoch);
  if (!batch.ok()) return base::Annotate(batch.status(), absl::StrCat("reading a batch on worker '", worker, "'"));
  opened->skipped += batch->skipped;
  return batch;
}

absl::Status RegisterDataFunctions(rpc::Registry& registry) {
  // open(id, spec): opens the source; replies with its rows.
  RETURN_IF_ERROR(registry.RegisterFunction(
      OpenDataRequest::kFunction, [](rpc::CallContext& ctx, const rpc::Args& a) -> c10::IValue {
        const auto r = rpc::DecodeCallOrThrow<OpenDataRequest>(a);
        const data::SourceSpec spec = SpecOf(r);
        auto source = data::OpenSource(spec);
        if (!source.ok()) {
          throw std::invalid_argument(absl::StrCat("worker '", ctx.worker_name(), "': ", source.status().message()));
        }
        auto opened = std::make_shared<Opened>();
        opened->source = std::move(*source);
        const int64_t rows = opened->source->size();
        Table& t = TheTable();
        {
          absl::MutexLock lock(&t.mu);
          if (t.by_id.emplace(Key(ctx.worker_name(), r.source), opened).second) return rows;
        }
        // (`opened` is freed outside the lock.)
        throw std::invalid_argument(
            absl::StrCat("worker '", ctx.worker_name(), "' has data source ", r.source, " open already"));
      }));
  // skipped(id): the rows left out so far.
  RETURN_IF_ERROR(registry.RegisterFunction(
      DataSkippedRequest::kFunction, [](rpc::CallContext& ctx, const rpc::Args& a) -> c10::IValue {
        const int64_t source = rpc::DecodeCallOrThrow<DataSkippedRequest>(a).source;
        std::shared_ptr<Opened> opened = Find(ctx.worker_name(), source);
        if (!opened) {
          throw std::invalid_argument(
              absl::StrCat("worker '", ctx.worker_name(), "' has no data source ", source));
        }
        return opened->skipped.load();
      }));
  // close(id)
  return registry.RegisterFunction(CloseDataRequest::kFunction,
                                   [](rpc::CallContext& ctx, const rpc::Args& a) -> c10::IValue {
                                     const int64_t source = rpc::DecodeCallOrThrow<CloseDataRequest>(a).source;
                                     std::shared_ptr<Opened> closed;  // freed outside the lock
                                     Table& t = TheTable();
                                     absl::MutexLock lock(&t.mu);
                                     auto it = t.by_id.find(Key(ctx.worker_name(), source));
                                     if (it != t.by_id.end()) {
                                       closed = std::move(it->second);
                                       t.by_id.erase(it);
                                     }
                                     return c10::IValue();
                                   });
}

}  // namespace remora::pipeline
