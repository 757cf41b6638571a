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

namespace remora::pipeline {
namespace {

constexpr char kRowsTag[] = "remora.rows";

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

std::string WorkerName(CallContext& ctx) { return ctx.agent != nullptr ? ctx.agent->self().name : "?"; }

// The spec as a call argument (a tuple of its fields), and back.
c10::IValue SpecToIValue(const data::SourceSpec& s) {
  return c10::ivalue::Tuple::create({c10::IValue(s.dataset), s.train, s.rows, s.image_size,
                                     static_cast<int64_t>(s.threads), static_cast<int64_t>(s.seed),
                                     s.skip_bad_images, c10::IValue(s.listing_cache), s.val_fraction});
}

data::SourceSpec SpecFrom(const c10::IValue& v) {
  const c10::ArrayRef<c10::IValue> e = v.toTupleRef().elements().asArrayRef();
  if (e.size() != 9) {
    throw std::invalid_argument("data.open: a source spec of 9 fields (is the master another version of remora?)");
  }
  data::SourceSpec s;
  s.dataset = e[0].toStringRef();
  s.train = e[1].toBool();
  s.rows = e[2].toInt();
  s.image_size = e[3].toInt();
  s.threads = static_cast<int>(e[4].toInt());
  s.seed = static_cast<uint64_t>(e[5].toInt());
  s.skip_bad_images = e[6].toBool();
  s.listing_cache = e[7].toStringRef();
  s.val_fraction = e[8].toDouble();
  return s;
}

// Ids differ between the sources of this process and, with the clock in
// them, between masters that one worker meets.
std::atomic<int64_t> next_id{(absl::ToUnixMicros(absl::Now()) & 0xffffffffff) << 16};

}  // namespace

c10::IValue ToIValue(const WorkerRows& r) {
  return c10::ivalue::Tuple::create({c10::IValue(std::string(kRowsTag)), r.source, r.rows,
                                     static_cast<int64_t>(r.epoch)});
}

std::optional<WorkerRows> WorkerRowsFrom(const c10::IValue& v) {
  if (!v.isTuple()) return std::nullopt;
  const c10::ArrayRef<c10::IValue> e = v.toTupleRef().elements().asArrayRef();
  if (e.size() != 4 || !e[0].isString() || e[0].toStringRef() != kRowsTag) return std::nullopt;
  return WorkerRows{e[1].toInt(), e[2].toTensor(), static_cast<int>(e[3].toInt())};
}

absl::StatusOr<std::unique_ptr<WorkerData>> WorkerData::Open(Agent& agent, std::vector<std::string> workers,
                                                            const data::SourceSpec& spec, int64_t rows) {
  const int64_t id = next_id++;
  // Listing a large image folder takes a while on a cold disk.
  CallOptions slow;
  slow.timeout = absl::Minutes(30);
  std::vector<Future<c10::IValue>> opened;
  for (const std::string& w : workers) {
    opened.push_back(agent.rpc_async(w, "remora.data.open", {id, SpecToIValue(spec)}, slow));
  }
  // Owns the workers' sources from here: an error below closes them, once
  // every open has answered (a close must not overtake its open).
  std::unique_ptr<WorkerData> data(new WorkerData(agent, workers, id, rows));
  absl::Status first;
  for (size_t i = 0; i < workers.size(); ++i) {
    absl::StatusOr<c10::IValue> n = opened[i].wait();
    if (!first.ok()) continue;
    if (!n.ok()) {
      first = Annotate(n.status(), absl::StrCat("opening ", spec.dataset, " on worker '", workers[i],
                                                "', which reads the rows it trains on (give it the same files "
                                                "at the same path, or --data-on master)"));
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
    if (!agent_.IsLost(w)) agent_.rpc_async(w, "remora.data.close", {id_});
  }
}

absl::StatusOr<int64_t> WorkerData::skipped(
    const std::function<bool(const std::string&, const absl::Status&)>& lost) const {
  int64_t total = 0;
  for (const std::string& w : workers_) {
    if (!agent_.IsLost(w)) {
      absl::StatusOr<c10::IValue> n = agent_.rpc_sync(w, "remora.data.skipped", {id_});
      if (n.ok()) {
        last_skipped_[w] = n->toInt();
      } else if (!lost || !lost(w, n.status())) {
        return Annotate(n.status(), absl::StrCat("asking worker '", w, "' for its skipped images"));
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
  if (!batch.ok()) return Annotate(batch.status(), absl::StrCat("reading a batch on worker '", worker, "'"));
  opened->skipped += batch->skipped;
  return batch;
}

absl::Status RegisterDataFunctions(Registry& registry) {
  // open(id, spec): opens the source; replies with its rows.
  RETURN_IF_ERROR(registry.RegisterFunction(
      "remora.data.open", [](CallContext& ctx, const Args& a) -> c10::IValue {
        const data::SourceSpec spec = SpecFrom(a[1]);
        auto source = data::OpenSource(spec);
        if (!source.ok()) {
          throw std::invalid_argument(absl::StrCat("worker '", WorkerName(ctx), "': ", source.status().message()));
        }
        auto opened = std::make_shared<Opened>();
        opened->source = std::move(*source);
        const int64_t rows = opened->source->size();
        Table& t = TheTable();
        {
          absl::MutexLock lock(&t.mu);
          if (t.by_id.emplace(Key(WorkerName(ctx), a[0].toInt()), opened).second) return rows;
        }
        // (`opened` is freed outside the lock.)
        throw std::invalid_argument(
            absl::StrCat("worker '", WorkerName(ctx), "' has data source ", a[0].toInt(), " open already"));
      }));
  // skipped(id): the rows left out so far.
  RETURN_IF_ERROR(registry.RegisterFunction(
      "remora.data.skipped", [](CallContext& ctx, const Args& a) -> c10::IValue {
        std::shared_ptr<Opened> opened = Find(WorkerName(ctx), a[0].toInt());
        if (!opened) {
          throw std::invalid_argument(
              absl::StrCat("worker '", WorkerName(ctx), "' has no data source ", a[0].toInt()));
        }
        return opened->skipped.load();
      }));
  // close(id)
  return registry.RegisterFunction("remora.data.close", [](CallContext& ctx, const Args& a) -> c10::IValue {
    std::shared_ptr<Opened> closed;  // freed outside the lock
    Table& t = TheTable();
    absl::MutexLock lock(&t.mu);
    auto it = t.by_id.find(Key(WorkerName(ctx), a[0].toInt()));
    if (it != t.by_id.end()) {
      closed = std::move(it->second);
      t.by_id.erase(it);
    }
    return c10::IValue();
  });
}

}  // namespace remora::pipeline
