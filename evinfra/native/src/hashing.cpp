// Page-chained SHA-256 block hashes, byte-compatible with SGLang 0.5.23's KV events
// (core/hashing.py states the scheme): digest_i = SHA-256(digest_{i-1} || page_i as uint32 LE).
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>
#include <openssl/evp.h>

#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>

#include "common.h"

namespace evinfra {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "token pages are hashed as little-endian uint32: their in-memory bytes here");

constexpr size_t kDigest = 32;

using Tokens = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// One SHA-256 context for the whole loop: OpenSSL 3 looks the algorithm up on every
// EVP_DigestInit_ex given EVP_sha256(); a fetched EVP_MD skips that.
struct Sha256 {
  EVP_MD* md = EVP_MD_fetch(nullptr, "SHA256", nullptr);
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  ~Sha256() {
    EVP_MD_CTX_free(ctx);
    EVP_MD_free(md);
  }
  void digest(const unsigned char* prior, const void* page, size_t bytes, unsigned char* out) {
    if (!md || !ctx || !EVP_DigestInit_ex(ctx, md, nullptr) ||
        (prior && !EVP_DigestUpdate(ctx, prior, kDigest)) ||
        !EVP_DigestUpdate(ctx, page, bytes) || !EVP_DigestFinal_ex(ctx, out, nullptr)) {
      throw std::runtime_error("libcrypto SHA-256 failed");
    }
  }
};

// The event hash of a digest: its first 8 bytes read big-endian, as a signed int64.
Hash event_hash(const unsigned char* d) {
  uint64_t v = 0;
  for (size_t i = 0; i < 8; ++i) v = v << 8 | d[i];
  return static_cast<Hash>(v);
}

nb::tuple chain_pages(Tokens tokens, size_t page_size, std::optional<nb::bytes> prior) {
  if (page_size == 0) throw nb::value_error("page_size must be positive");
  if (prior && prior->size() != kDigest) throw nb::value_error("a prior digest has 32 bytes");
  const size_t pages = tokens.shape(0) / page_size;
  std::string digests(pages * kDigest, '\0');
  Hashes hashes(pages);
  {
    nb::gil_scoped_release unlocked;  // the tokens are read-only and owned by the caller
    Sha256 sha;
    auto* out = reinterpret_cast<unsigned char*>(digests.data());
    const unsigned char* before =
        prior ? reinterpret_cast<const unsigned char*>(prior->c_str()) : nullptr;
    for (size_t i = 0; i < pages; ++i) {
      sha.digest(before, tokens.data() + i * page_size, page_size * 4, out);
      hashes[i] = event_hash(out);
      before = out;
      out += kDigest;
    }
  }
  return nb::make_tuple(nb::bytes(digests.data(), digests.size()), nb::cast(hashes));
}

}  // namespace

void bind_hashing(nb::module_& m) {
  m.def("chain_pages", &chain_pages, nb::arg("tokens"), nb::arg("page_size"),
        nb::arg("prior").none(),
        "The digests (32 bytes per page, concatenated) and event hashes of the full pages of "
        "``tokens`` (contiguous uint32), chained after ``prior`` (None: a sequence's first "
        "page).");
}

}  // namespace evinfra
