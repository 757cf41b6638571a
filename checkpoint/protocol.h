// The checkpoint's calls from the master to each pipeline worker, one struct
// each (rpc/call.h): save this worker's owner file, wait for a background write,
// load an owner file, remove a checkpoint's files. Both sides encode and decode
// through these structs; a call that does not match is an error naming the
// call and the field.
//
// Thread-safety: plain structs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "rpc/call.h"

namespace remora::checkpoint {

// This worker's stages, optimizer and random generators, written
// atomically to `path`; replies OwnerFileWrittenReply. With `background` it
// replies (-1, "") once the state is copied, and the file is written on a
// thread of its own (OwnerFileWrittenRequest waits for it).
struct SaveOwnerFileRequest {
  static constexpr char kFunction[] = "remora.checkpoint.save_owner_file";
  std::string path;
  std::vector<int64_t> stages;  // the stages' indices
  std::vector<c10::IValue> stage_rrefs;  // the stages, in the same order
  c10::IValue optimizer;  // an RRef of the worker's optimizer, or None
  bool background = false;
  // A tensor left out: stage `omit_stage`'s named `omit_name` (the last
  // stage's copy of a tied weight, Manifest::tied_last); -1: none.
  int64_t omit_stage = -1;
  std::string omit_name;
  template <typename Fields>
  void Visit(Fields& f) {
    f("path", path)("stages", stages)("stage_rrefs", stage_rrefs)("optimizer", optimizer)("background", background)(
        "omit_stage", omit_stage, rpc::kMayBeLeftOff)("omit_name", omit_name, rpc::kMayBeLeftOff);
  }
};

// The file a save wrote: its size and CRC-32 (hex).
struct OwnerFileWrittenReply {
  static constexpr char kFunction[] = "remora.checkpoint.save_owner_file (reply)";
  int64_t bytes = 0;
  std::string crc32;
  template <typename Fields>
  void Visit(Fields& f) {
    f("bytes", bytes)("crc32", crc32);
  }
};

// Waits for the background write of `path` that a save started; replies
// OwnerFileWrittenReply, or the write's error.
struct OwnerFileWrittenRequest {
  static constexpr char kFunction[] = "remora.checkpoint.owner_file_written";
  std::string path;
  template <typename Fields>
  void Visit(Fields& f) {
    f("path", path);
  }
};

// The reverse of a save, after checking the file's size and CRC-32.
struct LoadOwnerFileRequest {
  static constexpr char kFunction[] = "remora.checkpoint.load_owner_file";
  std::string path;
  int64_t bytes = 0;
  std::string crc32;
  std::vector<int64_t> stages;
  std::vector<c10::IValue> stage_rrefs;
  c10::IValue optimizer;  // or None
  // The tensor SaveOwnerFileRequest left out, which stays as it is (Restore
  // sets it after); -1: none.
  int64_t omitted_stage = -1;
  std::string omitted_name;
  template <typename Fields>
  void Visit(Fields& f) {
    f("path", path)("bytes", bytes)("crc32", crc32)("stages", stages)("stage_rrefs", stage_rrefs)(
        "optimizer", optimizer)("omitted_stage", omitted_stage, rpc::kMayBeLeftOff)("omitted_name", omitted_name,
                                                                               rpc::kMayBeLeftOff);
  }
};

// Removes a checkpoint's owner files (and their temporaries) from `dir`,
// then `dir` if it is empty.
struct RemoveRequest {
  static constexpr char kFunction[] = "remora.checkpoint.remove";
  std::string dir;
  template <typename Fields>
  void Visit(Fields& f) {
    f("dir", dir);
  }
};

}  // namespace remora::checkpoint
