// Which cores a remora process runs on (a worker's --cpus).
//
// Workers that share a host's cores each run their threads on whichever
// core comes free; a core then runs one worker's compute pass, another's
// link reader, the master, and back, and each process's next pass finds
// the caches holding the others' code and data. pipeline_bench's one-process
// step takes about 2.7x as long after 64 MiB of other memory traffic as
// back to back (--cold-mib; docs/measurements.md, "Cores of their own").
// Pinning each worker to cores of its own keeps their caches apart.
//
//   ASSIGN_OR_RETURN(std::vector<int> cpus, ParseCpuList("0-3,8", AllowedCpus()));
//   RETURN_IF_ERROR(PinProcessToCpus(cpus));
//
// Thread-safety: the functions may be called from any thread; pinning
// while threads start leaves a thread started meanwhile on its creator's
// cores, which it inherits (so call it from the thread that starts the
// others, or before they start).
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace remora::runtime {

// The cores this process may run on (its affinity mask as it started, or
// as a launcher such as taskset or Slurm's --cpu-bind set it), ascending.
std::vector<int> AllowedCpus();

// `text` as a list of cores: "0-3,8,10-11" (ascending or not; a core at
// most once). An error names what is wrong: not a list, a range that runs
// backwards, a core given twice, a core not in `allowed`.
absl::StatusOr<std::vector<int>> ParseCpuList(const std::string& text, const std::vector<int>& allowed);

// "0-3,8": `cpus` (ascending) as a list, ranges folded.
std::string CpuListText(const std::vector<int>& cpus);

// Worker `index`'s share of `allowed` among `count` workers: consecutive
// cores, the shares within one core of equal size; with more workers than
// cores, one core each, round robin. Empty for an index outside [0, count).
std::vector<int> ShareOfCpus(const std::vector<int>& allowed, int index, int count);

// Pins every thread of this process to `cpus` (threads started later
// inherit it from their creator). An error names the thread and the
// cores the kernel refused.
absl::Status PinProcessToCpus(const std::vector<int>& cpus);

}  // namespace remora::runtime
