// kernels/checksum.h: the values must never change (the NVMe store compares what it wrote, and a
// resume compares checksums and the data fingerprint that older binaries wrote into checkpoints),
// and they must not depend on how the bytes are split.
#include "kernels/checksum.h"

#include <gtest/gtest.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "../support/test_seed.h"
#include "kernels/error.h"

namespace rondo::kernels {
namespace {

std::vector<unsigned char> pattern(std::size_t n) {
  std::vector<unsigned char> b(n);
  for (std::size_t i = 0; i < n; ++i)
    b[i] = static_cast<unsigned char>(i * 7 + 3);
  return b;
}

// The values of the distribution's libxxhash (XXH3_64bits, seed 0; its own build, not our inline
// AVX2 one) for the empty string, a short input (17-128 bytes) and a long one (> 240 bytes: the
// vectorised accumulation).
TEST(Xxh3, EqualsTheLibraryValues) {
  EXPECT_EQ(hex64(xxh3("", 0)), "2d06800538d394c2");
  EXPECT_EQ(hex64(xxh3("foobar", 6)), "d78fda63144c5c84");
  const std::vector<unsigned char> b = pattern(1000);
  EXPECT_EQ(hex64(xxh3(b.data(), 22)), "efec34df796b95f3");
  EXPECT_EQ(hex64(xxh3(b.data(), 1000)), "6c4f14bd97bd9e82");
}

// Streaming and gathered segments give the one-shot value, however the bytes are cut.
TEST(Xxh3, SplittingTheBytesChangesNothing) {
  std::mt19937_64 rng = test::rng_for_test();
  for (std::size_t n : {std::size_t{1}, std::size_t{22}, std::size_t{64}, std::size_t{241},
                        std::size_t{1} << 20, (std::size_t{1} << 20) + 13}) {
    SCOPED_TRACE(n);
    std::vector<unsigned char> b(n);
    for (unsigned char& c : b)
      c = static_cast<unsigned char>(rng());
    const std::uint64_t whole = xxh3(b.data(), n);
    // Cut into up to 5 pieces at random points (some of them empty).
    std::vector<std::size_t> cuts = {0, n};
    for (int i = 0; i < 4; ++i)
      cuts.push_back(rng() % (n + 1));
    std::sort(cuts.begin(), cuts.end());
    Xxh3 h;
    std::vector<iovec> segments;
    for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
      h.update(b.data() + cuts[i], cuts[i + 1] - cuts[i]);
      segments.push_back({b.data() + cuts[i], cuts[i + 1] - cuts[i]});
    }
    EXPECT_EQ(h.digest(), whole);
    EXPECT_EQ(xxh3_segments(segments.data(), static_cast<int>(segments.size())), whole);
  }
}

TEST(Xxh3, FileDigestIsTheBytesAndTheirXxh3) {
  const std::filesystem::path p =
      std::filesystem::temp_directory_path() / ("rondo-checksum-" + std::to_string(::getpid()));
  const std::vector<unsigned char> b = pattern((std::size_t{9} << 20) + 5);  // > two 4 MiB reads
  std::ofstream(p, std::ios::binary)
      .write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  const FileDigest d = file_xxh3(p.string());
  std::filesystem::remove(p);
  EXPECT_EQ(d.bytes, b.size());
  EXPECT_EQ(d.xxh3, xxh3(b.data(), b.size()));
  try {
    file_xxh3(p.string());
    ADD_FAILURE() << "read a file that is gone";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot open " + p.string()), std::string::npos)
        << e.what();
  }
}

// FNV-1a 64's published values, and continuing a hash equals hashing the concatenation: the data
// fingerprint (engine/session.cpp) hashes example after example this way.
TEST(Fnv1a64, EqualsThePublishedValuesAndContinues) {
  EXPECT_EQ(fnv1a64(kFnv1a64Basis, "", 0), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a64(kFnv1a64Basis, "a", 1), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a64(kFnv1a64Basis, "foobar", 6), 0x85944171f73967e8ull);
  EXPECT_EQ(fnv1a64(fnv1a64(kFnv1a64Basis, "foo", 3), "bar", 3), 0x85944171f73967e8ull);
}

}  // namespace
}  // namespace rondo::kernels
