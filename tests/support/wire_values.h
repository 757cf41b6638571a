// Wire values built by hand, for tests and the fuzz corpus that need frames
// a real encoder would not make (or would make only through a whole agent).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "proto/agent.pb.h"
#include "proto/request.h"
#include "proto/rref.pb.h"

namespace remora {

// Stateless; derive from it (or call WireValues::Int...) to use the names.
struct WireValues {
  // Makes `body` the request's body (its kind and bytes), keeping the
  // sender and the autograd metadata already set.
  static void SetBody(wire::Request* r, const google::protobuf::Message& body) {
    wire::Request made = wire::MakeRequest(body);
    r->set_kind(made.kind());
    r->set_body(made.body());
  }
  static wire::ForkRequest Fork(wire::Guid rref, wire::Guid fork) {
    wire::ForkRequest f;
    *f.mutable_rref_id() = std::move(rref);
    *f.mutable_fork_id() = std::move(fork);
    return f;
  }
  static wire::FetchRequest Fetch(wire::Guid rref, wire::Guid fork) {
    wire::FetchRequest f;
    *f.mutable_rref_id() = std::move(rref);
    *f.mutable_fork_id() = std::move(fork);
    return f;
  }
  static wire::UserDelete Delete(wire::Guid rref, wire::Guid fork) {
    wire::UserDelete d;
    *d.mutable_rref_id() = std::move(rref);
    *d.mutable_fork_id() = std::move(fork);
    return d;
  }
  static wire::Value Undefined() {
    wire::Value v;
    v.mutable_tensor()->set_dtype(-1);
    return v;
  }
  static wire::Value Int(int64_t i) {
    wire::Value v;
    v.set_i(i);
    return v;
  }
  static wire::Value Double(double d) {
    wire::Value v;
    v.set_d(d);
    return v;
  }
  static wire::Value Bool(bool b) {
    wire::Value v;
    v.set_b(b);
    return v;
  }
  static wire::Value Str(const std::string& s) {
    wire::Value v;
    v.set_s(s);
    return v;
  }
  static wire::Value List(wire::ElemKind elem, std::vector<wire::Value> items, bool tuple = false) {
    wire::Value v;
    auto* l = tuple ? v.mutable_tuple() : v.mutable_list();
    l->set_elem(elem);
    for (auto& i : items) *l->add_items() = std::move(i);
    return v;
  }
  static wire::Value Dict(wire::ElemKind key, wire::ElemKind value,
                          std::vector<std::pair<wire::Value, wire::Value>> entries) {
    wire::Value v;
    auto* d = v.mutable_dict();
    d->set_key(key);
    d->set_value(value);
    for (auto& [k, val] : entries) {
      *d->add_keys() = std::move(k);
      *d->add_values() = std::move(val);
    }
    return v;
  }
  static wire::Guid Guid(uint32_t worker, uint64_t local) {
    wire::Guid g;
    g.set_worker(worker);
    g.set_local(local);
    return g;
  }
  static wire::Value RRefValue(uint32_t owner, wire::Guid id, wire::Guid fork, uint32_t parent) {
    wire::Value v;
    auto* r = v.mutable_rref();
    r->set_owner(owner);
    *r->mutable_rref_id() = id;
    *r->mutable_fork_id() = fork;
    r->set_parent(parent);
    return v;
  }
};

}  // namespace remora
