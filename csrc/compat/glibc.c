/*
 * Keeps tpcomm._C within manylinux_2_28 (glibc 2.28) when built on a newer
 * system. libstdc++'s headers (GCC 11 and later, on glibc 2.32 and later)
 * read glibc's __libc_single_threaded to skip atomic reference counting in a
 * process that has one thread; that symbol is versioned GLIBC_2.32. This
 * library defines its own copy, hidden, so its references bind here and need
 * no glibc symbol newer than 2.28.
 *
 * Invariant: the value is 0 ("other threads may exist"), never changed, so
 * the library's inlined libstdc++ code always takes the atomic path: correct
 * in every process, single-threaded or not.
 */
__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;
