/* LD_PRELOAD shim that names what glibc's free lists cannot: a double free (from any two
 * threads) or a write into a freed small block, with the stack of every free involved.
 * free() of a block of at most QUARANTINE_MAX usable bytes fills it with a canary and holds it
 * back in a FIFO of QUARANTINE_SLOTS blocks; glibc gets it only when it leaves the FIFO, after
 * its canary is checked. A free of a block still in the FIFO is a double free; a changed canary
 * (at eviction or at exit) is a write after free, reported with the bytes written (a float, a
 * pointer, a counter: what they look like says who wrote them).
 *
 * Why beside scripts/guard_free.c: that shim faults in the writer's own instruction but costs
 * pages per block (runs 4x slower); this one costs a memset and a lock per small free, so a
 * repeat loop can run under it at full speed. It also sees what the guard cannot: a block freed
 * by two threads lands in both threads' tcache lists (glibc checks only the caller's list), the
 * lists then share chunks and their counts lie, and a later malloc(<=24) in one of the threads
 * dereferences a bad list head (issue 30's SIGSEGV in tcache_get, which shows no writer).
 *
 *   gcc -O2 -shared -fPIC -o /tmp/libfree_quarantine.so scripts/free_quarantine.c
 *   REPEAT_CORES=/tmp/cores bash scripts/repeat_module.sh PYTHON tests/test_x.py 50 OUT \
 *       LD_PRELOAD=/tmp/libfree_quarantine.so QUARANTINE_DIR=/tmp/fq
 * Settings (environment):
 *   QUARANTINE_MAX (default 24): largest usable size held back; 24 is glibc's 32-byte chunk class
 *   QUARANTINE_SLOTS (default 65536): blocks held back per process
 *   QUARANTINE_DEPTH (default 12, at most 16, 0 for none): frames kept per free
 *   QUARANTINE_DIR: also write each report to DIR/quarantine.<pid>.txt (stderr always)
 *   QUARANTINE_ABORT (default 1): abort() after a report, so the process dies with SIGABRT and
 *     a core (0: count and go on)
 *   QUARANTINE_STATS (default 0): at exit, print the frees held back and the reports made (to
 *     DIR/stats.<pid>.txt with QUARANTINE_DIR, else to stderr)
 * A debugging tool, not part of the package. */
#define _GNU_SOURCE
#include <execinfo.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

extern void __libc_free(void *);
extern size_t malloc_usable_size(void *);

#define CANARY 0xFB
#define MAX_DEPTH 16

typedef struct {
    void *p;
    size_t size; /* usable bytes filled with the canary */
    pid_t tid;
    int depth;
    void *frames[MAX_DEPTH];
} slot_t;

static slot_t *ring;
static size_t nslots = 65536, next_slot, held;
static size_t max_usable = 24;
static int depth = 12, abort_on_report = 1, stats;
static atomic_flag lock = ATOMIC_FLAG_INIT;
static int ready;
static unsigned long frees_held, reports;
static char dir[512];
static __thread int in_hook;

static void lock_ring(void) {
    while (atomic_flag_test_and_set_explicit(&lock, memory_order_acquire)) sched_yield();
}
static void unlock_ring(void) { atomic_flag_clear_explicit(&lock, memory_order_release); }
static void child_unlock(void) { unlock_ring(); }

static void say(int fd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(int fd, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof buf - 1) n = sizeof buf - 1;
    if (n > 0 && write(fd, buf, (size_t)n) < 0) return;
}

static void describe_slot(int fd, const char *what, const slot_t *s) {
    say(fd, "  %s by thread %d:\n", what, s->tid);
    if (s->depth > 0) backtrace_symbols_fd((void *const *)s->frames, s->depth, fd);
    else say(fd, "    (no frames kept: QUARANTINE_DEPTH=0)\n");
}

static void bytes_of(int fd, const unsigned char *b, size_t n) {
    say(fd, "  bytes now:");
    for (size_t i = 0; i < n; i++) say(fd, "%s%02x", i % 8 ? "" : " ", b[i]);
    say(fd, "\n  as float32:");
    for (size_t i = 0; i + 4 <= n && i < 32; i += 4) {
        float f;
        memcpy(&f, b + i, 4);
        say(fd, " %g", (double)f);
    }
    say(fd, "\n  as int64:");
    for (size_t i = 0; i + 8 <= n && i < 32; i += 8) {
        int64_t v;
        memcpy(&v, b + i, 8);
        say(fd, " %lld (0x%llx)", (long long)v, (unsigned long long)v);
    }
    say(fd, "\n");
}

/* One report to stderr and, with QUARANTINE_DIR, to DIR/quarantine.<pid>.txt. */
static void report(const char *kind, const slot_t *s, const void *now_frames_src, int now_depth) {
    int fds[2] = {2, -1};
    reports++;
    if (dir[0]) {
        char path[600];
        snprintf(path, sizeof path, "%s/quarantine.%d.txt", dir, (int)getpid());
        fds[1] = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    }
    for (int k = 0; k < 2; k++) {
        int fd = fds[k];
        if (fd < 0) continue;
        say(fd, "free_quarantine: %s of a %zu-byte block at %p (pid %d, seen by thread %d)\n",
            kind, s->size, s->p, (int)getpid(), (int)gettid());
        if (strcmp(kind, "write after free") == 0) bytes_of(fd, s->p, s->size);
        describe_slot(fd, "freed", s);
        if (now_frames_src) {
            say(fd, "  freed again by thread %d:\n", (int)gettid());
            backtrace_symbols_fd((void *const *)now_frames_src, now_depth, fd);
        }
    }
    if (fds[1] >= 0) close(fds[1]);
}

static int canary_intact(const slot_t *s) {
    const unsigned char *b = s->p;
    for (size_t i = 0; i < s->size; i++)
        if (b[i] != CANARY) return 0;
    return 1;
}

static void maybe_abort(void) {
    if (abort_on_report) {
        unlock_ring();
        abort();
    }
}

__attribute__((constructor)) static void quarantine_init(void) {
    const char *v;
    if ((v = getenv("QUARANTINE_MAX"))) max_usable = strtoul(v, NULL, 10);
    if ((v = getenv("QUARANTINE_SLOTS"))) nslots = strtoul(v, NULL, 10);
    if ((v = getenv("QUARANTINE_DEPTH"))) depth = atoi(v);
    if ((v = getenv("QUARANTINE_ABORT"))) abort_on_report = atoi(v);
    if ((v = getenv("QUARANTINE_STATS"))) stats = atoi(v);
    if ((v = getenv("QUARANTINE_DIR"))) snprintf(dir, sizeof dir, "%s", v);
    if (depth < 0) depth = 0;
    if (depth > MAX_DEPTH) depth = MAX_DEPTH;
    if (nslots == 0) return;
    void *r = mmap(NULL, nslots * sizeof(slot_t), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r == MAP_FAILED) return;
    ring = r;
    if (depth) { /* the unwinder loads libgcc_s (and mallocs) on its first call: do it now */
        void *f[2];
        in_hook = 1;
        backtrace(f, 2);
        in_hook = 0;
    }
    /* a fork while another thread holds the lock would leave the child's ring locked */
    pthread_atfork(lock_ring, unlock_ring, child_unlock);
    ready = 1;
}

/* Every block still held: a canary changed since its free is a write after free. */
static void scan_all(void) {
    if (!ready) return;
    in_hook = 1;
    lock_ring();
    for (size_t i = 0; i < held; i++) {
        slot_t *s = &ring[i];
        if (s->p && !canary_intact(s)) {
            report("write after free", s, NULL, 0);
            maybe_abort();
        }
    }
    if (stats) {
        int fd = 2;
        if (dir[0]) { /* a rank's stderr may be a test runner's capture */
            char path[600];
            snprintf(path, sizeof path, "%s/stats.%d.txt", dir, (int)getpid());
            fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
        }
        if (fd >= 0)
            say(fd, "free_quarantine: pid %d held back %lu frees of <= %zu bytes, %lu reports\n",
                (int)getpid(), frees_held, max_usable, reports);
        if (fd > 2) close(fd);
    }
    unlock_ring();
    in_hook = 0;
}

__attribute__((destructor)) static void quarantine_fini(void) { scan_all(); }

/* os._exit (a forkserver's or multiprocessing's child) skips destructors: scan first. */
void _exit(int status) {
    scan_all();
    syscall(SYS_exit_group, status);
    __builtin_unreachable();
}

void free(void *p) {
    if (!p || !ready || in_hook) {
        __libc_free(p);
        return;
    }
    size_t n = malloc_usable_size(p);
    if (n > max_usable) {
        __libc_free(p);
        return;
    }
    in_hook = 1;
    void *frames[MAX_DEPTH];
    int d = depth ? backtrace(frames, depth) : 0;
    lock_ring();
    if (n && memchr(p, CANARY, 1)) { /* cheap filter, then the full checks */
        const unsigned char *b = p;
        size_t i = 0;
        while (i < n && b[i] == CANARY) i++;
        if (i == n)
            for (size_t k = 0; k < held; k++)
                if (ring[k].p == p) {
                    report("double free", &ring[k], frames, d);
                    maybe_abort();
                    unlock_ring(); /* counted only: keep the block held once */
                    in_hook = 0;
                    return;
                }
    }
    slot_t *s = &ring[next_slot];
    void *evict = NULL;
    if (s->p) {
        if (!canary_intact(s)) {
            report("write after free", s, NULL, 0);
            maybe_abort();
        }
        evict = s->p;
    } else {
        held++;
    }
    memset(p, CANARY, n);
    s->p = p;
    s->size = n;
    s->tid = gettid();
    s->depth = d;
    memcpy(s->frames, frames, (size_t)d * sizeof(void *));
    next_slot = (next_slot + 1) % nslots;
    frees_held++;
    unlock_ring();
    if (evict) __libc_free(evict);
    in_hook = 0;
}
