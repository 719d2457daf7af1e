/* LD_PRELOAD shim: every posix_memalign of at most GUARD_MAX bytes (c10's CPU tensor storages)
 * gets a page of its own in a reserved arena, ending at the page's end; free() makes the page
 * inaccessible and never reuses it. A later write into a freed small storage, or an overrun past
 * its 64-byte-rounded end, faults in the writer's own instruction: the core names it. Memory
 * corruption that glibc only notices later, in another thread's malloc (issue 30's crash), is
 * caught where it happens. A debugging tool, not part of the package:
 *   gcc -O2 -shared -fPIC -o /tmp/libguard_free.so scripts/guard_free.c
 *   sysctl -w vm.max_map_count=1048576   # two mappings per live small storage
 *   REPEAT_CORES=/tmp/cores bash scripts/repeat_module.sh PYTHON tests/test_x.py 50 OUT \
 *       LD_PRELOAD=/tmp/libguard_free.so
 * GUARD_MAX (default 256): the largest size guarded. Freed pages are never reused: the arena
 * (256 GiB of address space, no memory until used) holds 2^25 small allocations. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

extern void __libc_free(void *);
extern void *__libc_memalign(size_t, size_t);
extern void *__libc_malloc(size_t);
extern void *__libc_realloc(void *, size_t);

#define PAGE 4096UL
#define ARENA (1UL << 38)
static char *arena;
static _Atomic size_t next_off;
static size_t max_small = 256;

__attribute__((constructor)) static void guard_init(void) {
    const char *m = getenv("GUARD_MAX");
    if (m) max_small = strtoul(m, NULL, 10);
    void *a = mmap(NULL, ARENA, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    arena = a == MAP_FAILED ? NULL : a;
}

static int in_arena(const void *p) {
    return arena && (const char *)p >= arena && (const char *)p < arena + ARENA;
}

int posix_memalign(void **out, size_t align, size_t n) {
    if (arena && n > 0 && n <= max_small && n <= PAGE - 64 && align <= 64) {
        size_t off = atomic_fetch_add(&next_off, 2 * PAGE);
        if (off + 2 * PAGE <= ARENA) {
            char *base = arena + off;
            if (mprotect(base, PAGE, PROT_READ | PROT_WRITE) == 0) {
                size_t r = (n + 63) & ~(size_t)63;
                *(size_t *)base = n;
                *out = base + PAGE - r;
                return 0;
            }
        }
    }
    void *p = __libc_memalign(align, n);
    if (!p) return ENOMEM;
    *out = p;
    return 0;
}

void free(void *p) {
    if (in_arena(p)) {
        char *base = (char *)((uintptr_t)p & ~(PAGE - 1));
        madvise(base, PAGE, MADV_DONTNEED);
        mprotect(base, PAGE, PROT_NONE);
        return;
    }
    __libc_free(p);
}

void *realloc(void *p, size_t n) {
    if (in_arena(p)) {
        char *base = (char *)((uintptr_t)p & ~(PAGE - 1));
        size_t old = *(size_t *)base;
        void *q = __libc_malloc(n ? n : 1);
        if (q) memcpy(q, p, old < n ? old : n);
        free(p);
        return q;
    }
    return __libc_realloc(p, n);
}
