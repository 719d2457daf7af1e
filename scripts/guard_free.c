/* LD_PRELOAD shim that catches a write into freed heap memory in the writer's own instruction.
 * Each guarded allocation gets pages of its own in a reserved arena, its data ending at the last
 * page's end; free() makes the pages inaccessible and never reuses them. A later write into the
 * freed block, a second free, or an overrun past its end (rounded up to its alignment) faults
 * where it happens, and the core names the writer. Heap corruption that glibc only notices later,
 * in another thread's malloc (issue 30's crash), is caught at its cause. A debugging tool, not
 * part of the package:
 *   gcc -O2 -shared -fPIC -o /tmp/libguard_free.so scripts/guard_free.c
 *   sysctl -w vm.max_map_count=1048576   # about two mappings per live guarded block
 *   REPEAT_CORES=/tmp/cores bash scripts/repeat_module.sh PYTHON tests/test_x.py 50 OUT \
 *       LD_PRELOAD=/tmp/libguard_free.so
 * What is guarded (sizes in bytes; everything else goes to glibc unchanged):
 *   GUARD_MAX (default 256): posix_memalign / aligned_alloc / memalign up to this size. On Linux
 *     these are c10's CPU tensor storages, so a large value guards every tensor.
 *   GUARD_MALLOC_MIN..GUARD_MALLOC_MAX (default off): malloc / calloc / realloc / operator new
 *     in this size range, e.g. 17..24 for the objects of glibc's 32-byte chunk class.
 * Freed pages are never reused: the arena (1 TiB of address space, no memory until used) holds
 * 2^27 small blocks; once it is used up, allocations go to glibc again. Cores leave the arena
 * out (the writer's frame and registers are outside it). */
#define _GNU_SOURCE
#include <dlfcn.h>
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
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);

#define PAGE 4096UL
#define ARENA (1UL << 40)
#define HEADER 16UL /* before the data: the requested size and the block's page count */
static char *arena;
static _Atomic size_t next_off;
static size_t aligned_max = 256, malloc_min = 1, malloc_max = 0;

__attribute__((constructor)) static void guard_init(void) {
    const char *v;
    if ((v = getenv("GUARD_MAX"))) aligned_max = strtoul(v, NULL, 10);
    if ((v = getenv("GUARD_MALLOC_MIN"))) malloc_min = strtoul(v, NULL, 10);
    if ((v = getenv("GUARD_MALLOC_MAX"))) malloc_max = strtoul(v, NULL, 10);
    void *a = mmap(NULL, ARENA, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    arena = a == MAP_FAILED ? NULL : a;
    /* a core would otherwise hold the whole reserved terabyte (as zeros, when the kernel pipes
     * it to a handler: scripts/core_route.sh); guarded blocks are left out of cores with it */
    if (arena) madvise(arena, ARENA, MADV_DONTDUMP);
}

static int in_arena(const void *p) {
    return arena && (const char *)p >= arena && (const char *)p < arena + ARENA;
}

/* n bytes aligned to `align` (a power of two, at least 16), ending at a page's end, in pages
 * of their own followed by an inaccessible page; NULL when the arena is used up. */
static void *guarded(size_t n, size_t align) {
    size_t r = (n + align - 1) & ~(align - 1);
    if (r < n || r > ARENA / 4) return NULL;
    size_t pages = (r + HEADER + PAGE - 1) / PAGE;
    size_t off = atomic_fetch_add(&next_off, (pages + 1) * PAGE);
    if (off + (pages + 1) * PAGE > ARENA) return NULL;
    char *base = arena + off;
    if (mprotect(base, pages * PAGE, PROT_READ | PROT_WRITE)) return NULL;
    char *p = base + pages * PAGE - r;
    ((size_t *)p)[-2] = n;
    ((size_t *)p)[-1] = pages;
    return p;
}

static size_t guarded_size(const void *p) { return ((const size_t *)p)[-2]; }

/* glibc's malloc_usable_size, which this file's own definition hides. */
static size_t libc_usable_size(void *p) {
    static size_t (*fn)(void *);
    if (!fn) fn = (size_t (*)(void *))dlsym(RTLD_NEXT, "malloc_usable_size");
    return fn ? fn(p) : 0;
}

static void guarded_free(void *p) {
    size_t pages = ((size_t *)p)[-1];
    /* the block ends at the first page boundary at or after its last byte */
    uintptr_t end = ((uintptr_t)p + guarded_size(p) + PAGE - 1) & ~(PAGE - 1);
    char *base = (char *)(end - pages * PAGE);
    madvise(base, pages * PAGE, MADV_DONTNEED);
    mprotect(base, pages * PAGE, PROT_NONE);
}

static int guard_malloc(size_t n) { return arena && n >= malloc_min && n <= malloc_max; }

static int guard_aligned(size_t n, size_t align) {
    return arena && n > 0 && n <= aligned_max && align <= PAGE && (align & (align - 1)) == 0;
}

void *malloc(size_t n) {
    void *p = guard_malloc(n) ? guarded(n, 16) : NULL;
    return p ? p : __libc_malloc(n);
}

void *calloc(size_t k, size_t n) {
    size_t total;
    if (__builtin_mul_overflow(k, n, &total)) {
        errno = ENOMEM;
        return NULL;
    }
    void *p = guard_malloc(total) ? guarded(total, 16) : NULL; /* fresh pages are zero */
    return p ? p : __libc_calloc(k, n);
}

void *memalign(size_t align, size_t n) {
    void *p = guard_aligned(n, align) ? guarded(n, align < 16 ? 16 : align) : NULL;
    return p ? p : __libc_memalign(align, n);
}

int posix_memalign(void **out, size_t align, size_t n) {
    void *p = memalign(align, n);
    if (!p) return ENOMEM;
    *out = p;
    return 0;
}

void *aligned_alloc(size_t align, size_t n) { return memalign(align, n); }

void free(void *p) {
    if (in_arena(p)) {
        guarded_free(p);
        return;
    }
    __libc_free(p);
}

void *realloc(void *p, size_t n) {
    if (in_arena(p)) {
        size_t old = guarded_size(p);
        void *q = malloc(n ? n : 1);
        if (q) {
            memcpy(q, p, old < n ? old : n);
            guarded_free(p);
        }
        return q;
    }
    if (!p) return malloc(n);
    if (guard_malloc(n)) { /* a glibc block grown or shrunk into the guarded range */
        void *q = guarded(n, 16);
        if (q) {
            size_t old = libc_usable_size(p);
            memcpy(q, p, old < n ? old : n);
            __libc_free(p);
            return q;
        }
    }
    return __libc_realloc(p, n);
}

size_t malloc_usable_size(void *p) {
    if (in_arena(p)) return guarded_size(p);
    return p ? libc_usable_size(p) : 0;
}
