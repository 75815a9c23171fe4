// Per-enumerator tables (names, sizes): an enum's entries listed once, in declaration order,
// instead of one switch case each. Host-only (compiles with g++ alone).
#pragma once

#include <cstddef>
#include <type_traits>

namespace gdn {

// table[e] for an enum whose values run 0, 1, ... in declaration order (the table lists them in
// that order), or `otherwise` for a value past the table.
template <class Enum, class Entry, std::size_t N>
constexpr Entry table_entry(Enum e, const Entry (&table)[N],
                            std::type_identity_t<Entry> otherwise) noexcept {
  const auto i = static_cast<std::size_t>(e);
  return i < N ? table[i] : otherwise;
}

}  // namespace gdn
