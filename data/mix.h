// data::Mix: 64 well-mixed bits from (seed, epoch, index), splitmix64's
// steps over the three, the same on every machine. An image folder's crops
// draw from it (imagefolder.cc) and its held-out fraction hashes with it
// (image_listing.cc): a change here changes every crop and moves images
// between training and validation.
#pragma once

#include <cstdint>
#include <initializer_list>

namespace remora::data {

inline uint64_t Mix(uint64_t seed, uint64_t epoch, uint64_t index) {
  uint64_t x = seed;
  for (uint64_t v : {epoch, index}) {
    x += 0x9e3779b97f4a7c15ull + v;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
  }
  return x;
}

}  // namespace remora::data
