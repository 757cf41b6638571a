// Requests by kind: a wire::Request carries the full protobuf name of its
// body message in `kind` and the serialized body in `body`
// (proto/agent.proto). MakeRequest builds one; RequestBody reads one back.
// Any layer that sends requests uses these (the channels' control messages,
// RRefs, the agent); rpc/dispatch.h routes received ones to their handlers.
//
// Stateless; thread-safe.
#pragma once

#include <string>

#include <google/protobuf/message.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "proto/agent.pb.h"

namespace remora::wire {

// A request whose body is `body`.
inline wire::Request MakeRequest(const google::protobuf::Message& body) {
  wire::Request request;
  request.set_kind(body.GetDescriptor()->full_name());
  body.SerializeToString(request.mutable_body());
  return request;
}

// The body of `request` as a `Body`; an error when it is of another kind or
// does not parse.
template <typename Body>
absl::StatusOr<Body> RequestBody(const wire::Request& request) {
  Body body;
  if (request.kind() != Body::descriptor()->full_name()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a request of kind '", request.kind().substr(0, 64), "' is not a ",
        Body::descriptor()->full_name()));
  }
  if (!body.ParseFromString(request.body())) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed body of a ", Body::descriptor()->full_name(), " request"));
  }
  return body;
}

}  // namespace remora::wire
