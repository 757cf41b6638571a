// libFuzzer target over request decoding: every input is taken as the bytes
// of a received frame and decoded as a worker would (see request_decoder.h),
// once as one slice and once cut into 7-byte slices. The two must agree.
// Crashes, sanitizer reports and disagreements stop the fuzzer.
//
//   build-fuzz/bin/request_fuzzer -max_total_time=60 CORPUS_DIR tests/fuzz/corpus
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <google/protobuf/stubs/logging.h>

#include "tests/fuzz/request_decoder.h"

// Protobuf logs every string field with invalid UTF-8 it parses; random
// inputs are full of them.
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  google::protobuf::SetLogHandler([](google::protobuf::LogLevel, const char*, int,
                                     const std::string&) {});
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  const absl::Status whole = remora::fuzz::DecodeRequestBytes(bytes);
  const absl::Status sliced = remora::fuzz::DecodeRequestBytes(bytes, 7);
  if (whole.code() != sliced.code()) {
    std::fprintf(stderr, "one slice: %s\n7-byte slices: %s\n", whole.ToString().c_str(),
                 sliced.ToString().c_str());
    std::abort();
  }
  return 0;
}
