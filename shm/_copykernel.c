/* The optional C kernel. `copy_runs`: one call copies a list of (src, dst, nbytes) runs with the GIL released,
 * with plain memcpy or with non-temporal (streaming) stores on x86-64. No threads here: the caller splits the
 * runs over its own copy threads. Addresses are raw: the caller has bounds-checked every run against memory
 * it maps. A page that vanishes under a mapping mid-copy (a segment truncated by its owner) raises
 * OSError(EFAULT) instead of killing the process with SIGBUS; `copy_run` and `load_word` do the same for one
 * run and one word. `index_pull_key` and `index_unpin_key`: a puller's pull of a key through an owner's
 * published index (llm_datadist/_puller/fresh.py has the rules). Every read or write of memory another process's file backs
 * (the index, a generation word, a segment) runs under the SIGBUS guard: a file truncated under its mapping
 * fails that call, never the process.
 * `vm_read_checked`: a repeated one-sided read of a peer's registered memory with its liveness and
 * generation checks (llm_datadist/_puller/oneside.py has the rules). Built by setup.py when a compiler is present
 * (optional); the package falls back to numpy and Python without it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#define HAVE_STREAMING 1
#else
#define HAVE_STREAMING 0
#endif

#if HAVE_STREAMING
/* One 64-byte line into a 16-byte-aligned destination, with streaming stores. */
static inline void stream_line(char *dst, const char *src)
{
    __m128i a = _mm_loadu_si128((const __m128i *)src);
    __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
    _mm_stream_si128((__m128i *)dst, a);
    _mm_stream_si128((__m128i *)(dst + 16), b);
    _mm_stream_si128((__m128i *)(dst + 32), c);
    _mm_stream_si128((__m128i *)(dst + 48), d);
}

/* Stream 64 bytes per iteration into 16-byte-aligned destinations; memcpy the unaligned head and tail. */
static void copy_streaming(char *dst, const char *src, size_t nbytes)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > nbytes)
        head = nbytes;
    memcpy(dst, src, head);
    dst += head, src += head, nbytes -= head;
    for (; nbytes >= 64; nbytes -= 64, src += 64, dst += 64)
        stream_line(dst, src);
    memcpy(dst, src, nbytes);
}
#endif

#if HAVE_STREAMING
/* Streaming copies made several at a time. One thread copying memory that no cache holds waits on one
 * stream of misses at a time; copying LANES spans a line each in turn keeps LANES streams in flight, which
 * on the development machine copies a thread's share 25-40% faster (scattered 32 KiB blocks, 256 KiB
 * chunks, long runs; on 4 KiB pages and on huge ones). A span is cut into pieces of LANE_PIECE, which fill
 * the lanes in turn; spans shorter than LANE_MIN are copied at once. Order is kept: a span that overlaps one
 * waiting in a lane (reads what it writes, writes what it reads or writes) waits until the lanes are
 * copied, so a list of runs ends as if copied one by one. */
#define LANES 4
#define LANE_PIECE ((size_t)64 << 10)
#define LANE_MIN ((size_t)4 << 10)

struct lanes {
    char *dst[LANES];
    const char *src[LANES];
    size_t nbytes[LANES];
    int count;
};

/* Copy what the lanes hold: their common length a line of each in turn, the rest of each alone. */
static void lanes_flush(struct lanes *l)
{
    int count = l->count;
    l->count = 0;
    size_t common = SIZE_MAX;
    for (int k = 0; k < count; k++) {
        size_t head = (16 - ((uintptr_t)l->dst[k] & 15)) & 15; /* every piece is longer */
        memcpy(l->dst[k], l->src[k], head);
        l->dst[k] += head, l->src[k] += head, l->nbytes[k] -= head;
        common = l->nbytes[k] < common ? l->nbytes[k] : common;
    }
    size_t lines = count > 1 ? common / 64 : 0;
    if (count == LANES) {
        char *d0 = l->dst[0], *d1 = l->dst[1], *d2 = l->dst[2], *d3 = l->dst[3];
        const char *s0 = l->src[0], *s1 = l->src[1], *s2 = l->src[2], *s3 = l->src[3];
        for (size_t i = 0; i < lines * 64; i += 64) {
            stream_line(d0 + i, s0 + i);
            stream_line(d1 + i, s1 + i);
            stream_line(d2 + i, s2 + i);
            stream_line(d3 + i, s3 + i);
        }
    } else {
        for (size_t i = 0; i < lines * 64; i += 64)
            for (int k = 0; k < count; k++)
                stream_line(l->dst[k] + i, l->src[k] + i);
    }
    for (int k = 0; k < count; k++)
        copy_streaming(l->dst[k] + lines * 64, l->src[k] + lines * 64, l->nbytes[k] - lines * 64);
}

static inline int spans_overlap(const char *a, size_t a_nbytes, const char *b, size_t b_nbytes)
{
    return a < b + b_nbytes && b < a + a_nbytes;
}

/* Copy nbytes from src to dst (which do not overlap) through the lanes: now, or by a later `lanes_add` or
 * `lanes_flush`. */
static void lanes_add(struct lanes *l, char *dst, const char *src, size_t nbytes)
{
    for (int k = 0; k < l->count; k++)
        if (spans_overlap(dst, nbytes, l->src[k], l->nbytes[k]) || spans_overlap(dst, nbytes, l->dst[k], l->nbytes[k])
            || spans_overlap(src, nbytes, l->dst[k], l->nbytes[k])) {
            lanes_flush(l);
            break;
        }
    if (nbytes < LANE_MIN) {
        copy_streaming(dst, src, nbytes);
        return;
    }
    while (nbytes > 0) {
        size_t piece = nbytes >= LANE_PIECE + LANE_MIN ? LANE_PIECE : nbytes; /* no short last piece */
        l->dst[l->count] = dst, l->src[l->count] = src, l->nbytes[l->count] = piece;
        if (++l->count == LANES)
            lanes_flush(l);
        dst += piece, src += piece, nbytes -= piece;
    }
}
#endif

/* Copies of a list of spans (`copy_add` each, then `copy_end`): with streaming stores through the lanes
 * when nontemporal (and the build has them; the caller fences after `copy_end`), else memcpy at once. */
struct copier {
    int nontemporal;
#if HAVE_STREAMING
    struct lanes lanes;
#endif
};

static inline void copy_add(struct copier *copier, char *dst, const char *src, size_t nbytes)
{
#if HAVE_STREAMING
    if (copier->nontemporal) {
        lanes_add(&copier->lanes, dst, src, nbytes);
        return;
    }
#endif
    memcpy(dst, src, nbytes);
}

static inline void copy_end(struct copier *copier)
{
#if HAVE_STREAMING
    if (copier->nontemporal && copier->lanes.count)
        lanes_flush(&copier->lanes);
#else
    (void)copier;
#endif
}

/* nbytes from src to dst, which do not overlap: with streaming stores when nontemporal (and the build has
 * them; the caller fences), else memcpy. */
static void copy_span(char *dst, const char *src, size_t nbytes, int nontemporal)
{
    struct copier copier = {.nontemporal = nontemporal};
    copy_add(&copier, dst, src, nbytes);
    copy_end(&copier);
}

/* SIGBUS (a file shrunk under its mapping) or SIGSEGV (memory a user registered and then unmapped) during
 * a copy jumps back to the copy on the faulting thread. The handlers are installed while any thread copies
 * (counted under a mutex) and the previous ones restored after, so that faulthandler and others keep both
 * signals outside our copies; one elsewhere meanwhile goes to the previous handler. */
static pthread_mutex_t guard_lock = PTHREAD_MUTEX_INITIALIZER;
static int guard_users;
static struct sigaction guard_previous_bus, guard_previous_segv;
/* initial-exec: reading it in the handler must not allocate (a dlopen'ed module's TLS may otherwise). */
static __thread sigjmp_buf *guard_jump __attribute__((tls_model("initial-exec")));

static void on_fault(int signum, siginfo_t *info, void *context)
{
    sigjmp_buf *jump = guard_jump;
    int fault = info->si_code > 0; /* raised by the kernel for an access, not sent by a process */
    if (jump != NULL && fault) {
        guard_jump = NULL;
        siglongjmp(*jump, 1);
    }
    /* Not our copy: do what the previous disposition would have done. */
    const struct sigaction *previous = signum == SIGSEGV ? &guard_previous_segv : &guard_previous_bus;
    if (previous->sa_flags & SA_SIGINFO) {
        previous->sa_sigaction(signum, info, context);
    } else if (previous->sa_handler != SIG_DFL && previous->sa_handler != SIG_IGN) {
        previous->sa_handler(signum);
    } else if (fault || previous->sa_handler == SIG_DFL) {
        signal(signum, SIG_DFL); /* a fault runs again and dies as it would have; a sent one is raised */
        if (!fault)
            raise(signum);
    }
}

static void guard_enter(void)
{
    pthread_mutex_lock(&guard_lock);
    if (guard_users++ == 0) {
        struct sigaction action;
        memset(&action, 0, sizeof action);
        action.sa_sigaction = on_fault;
        action.sa_flags = SA_SIGINFO;
        sigemptyset(&action.sa_mask);
        sigaction(SIGBUS, &action, &guard_previous_bus);
        sigaction(SIGSEGV, &action, &guard_previous_segv);
    }
    pthread_mutex_unlock(&guard_lock);
}

static void guard_leave(void)
{
    pthread_mutex_lock(&guard_lock);
    if (--guard_users == 0) {
        sigaction(SIGBUS, &guard_previous_bus, NULL);
        sigaction(SIGSEGV, &guard_previous_segv, NULL);
    }
    pthread_mutex_unlock(&guard_lock);
}

/* fn(arg) under the guard: its result, or `faulted` if memory vanished under a mapping meanwhile. fn must
 * hold nothing a jump out of it would leak (no lock taken inside it, no allocation). */
static int guarded(int (*fn)(void *), void *arg, int faulted)
{
    volatile int result = faulted;
    sigjmp_buf jump;
    guard_enter();
    if (sigsetjmp(jump, 1) == 0) {
        guard_jump = &jump;
        result = fn(arg);
    }
    guard_jump = NULL;
    guard_leave();
    return result;
}

/* A 1-D C-contiguous buffer of native uint64 (numpy's uint64 is 'L' on LP64 Linux, 'Q' elsewhere). */
static int get_column(PyObject *object, Py_buffer *view, const char *name)
{
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        /* numpy refuses a strided array with ValueError, memoryview with BufferError: both are a wrong type */
        if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_ValueError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s must be a contiguous uint64 buffer", name);
        }
        return -1;
    }
    const char *format = view->format != NULL ? view->format : "B";
    if (*format == '@' || *format == '=')
        format++;
    if (view->ndim != 1 || view->itemsize != 8 || (strcmp(format, "Q") != 0 && strcmp(format, "L") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D uint64 buffer, got format '%s' itemsize %zd ndim %d",
                     name, view->format != NULL ? view->format : "B", view->itemsize, view->ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int get_address(PyObject *object, uint64_t *address, const char *name)
{
    if (!PyLong_Check(object)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", name, Py_TYPE(object)->tp_name);
        return -1;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(object);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "%s must be an address in [0, 2**64)", name);
        return -1;
    }
    *address = value;
    return 0;
}

PyDoc_STRVAR(copy_runs_doc,
"copy_runs(src_base, dst_base, src_offsets, dst_offsets, lengths, nontemporal, helper=False)\n--\n\n"
"Copy run i: lengths[i] bytes from address src_base + src_offsets[i] to dst_base + dst_offsets[i], in\n"
"order, with the GIL released; streaming stores when nontemporal (x86-64 only; memcpy elsewhere); with\n"
"helper, the process's copy helper thread takes a share of a large copy (no run may overlap then). The\n"
"columns are 1-D contiguous uint64 buffers of equal length. A run whose two ranges overlap is moved as\n"
"memmove does. TypeError/ValueError on bad arguments or a run past 2**64 (nothing copied then);\n"
"OSError(EFAULT) when memory vanished under a mapping mid-copy (earlier runs are copied).");

/* Runs as the caller gave them: both bases, the three columns (held until release_runs), checked. */
struct runs {
    uint64_t src_base, dst_base;
    const uint64_t *src_offsets, *dst_offsets, *lengths;
    Py_ssize_t count;
    Py_buffer views[3];
    int got;
};

static int get_runs(struct runs *runs, PyObject *src_object, PyObject *dst_object, PyObject *const columns[3])
{
    static const char *names[3] = {"src_offsets", "dst_offsets", "lengths"};
    runs->got = 0;
    if (get_address(src_object, &runs->src_base, "src_base") < 0 ||
        get_address(dst_object, &runs->dst_base, "dst_base") < 0)
        return -1;
    for (; runs->got < 3; runs->got++)
        if (get_column(columns[runs->got], &runs->views[runs->got], names[runs->got]) < 0)
            return -1;
    Py_ssize_t count = runs->views[0].shape[0];
    if (runs->views[1].shape[0] != count || runs->views[2].shape[0] != count) {
        PyErr_SetString(PyExc_ValueError, "src_offsets, dst_offsets and lengths must have equal lengths");
        return -1;
    }
    const uint64_t *src_offsets = runs->views[0].buf, *dst_offsets = runs->views[1].buf;
    const uint64_t *lengths = runs->views[2].buf;
    uint64_t src_base = runs->src_base, dst_base = runs->dst_base;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (src_offsets[i] > UINT64_MAX - src_base || lengths[i] > UINT64_MAX - (src_base + src_offsets[i]) ||
            dst_offsets[i] > UINT64_MAX - dst_base || lengths[i] > UINT64_MAX - (dst_base + dst_offsets[i])) {
            PyErr_Format(PyExc_ValueError, "run %zd passes the end of the address space", i);
            return -1;
        }
    }
    runs->src_offsets = src_offsets, runs->dst_offsets = dst_offsets, runs->lengths = lengths;
    runs->count = count;
    return 0;
}

static void release_runs(struct runs *runs)
{
    while (runs->got > 0)
        PyBuffer_Release(&runs->views[--runs->got]);
}

/* Copy every run in order, without the GIL: -1, or the run that met a vanished page. */
static Py_ssize_t copy_all(const struct runs *runs, int nontemporal)
{
    volatile Py_ssize_t faulted = -1;
    sigjmp_buf jump;
    guard_enter();
    if (sigsetjmp(jump, 1) == 0) {
        guard_jump = &jump;
        struct copier copier = {.nontemporal = nontemporal};
        for (Py_ssize_t i = 0; i < runs->count; i++) {
            faulted = i; /* or one before it, still in the lanes */
            char *dst = (char *)(uintptr_t)(runs->dst_base + runs->dst_offsets[i]);
            const char *src = (const char *)(uintptr_t)(runs->src_base + runs->src_offsets[i]);
            size_t nbytes = (size_t)runs->lengths[i];
            if (dst < src + nbytes && src < dst + nbytes) {
                copy_end(&copier); /* what came before it first */
                memmove(dst, src, nbytes);
            } else {
                copy_add(&copier, dst, src, nbytes);
            }
        }
        copy_end(&copier);
        faulted = -1;
    }
    guard_jump = NULL;
    guard_leave();
#if HAVE_STREAMING
    if (nontemporal)
        _mm_sfence(); /* streaming stores are weakly ordered: make them visible before we return */
#endif
    return faulted;
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ /* as HAVE_INDEX, defined below */
#define HAVE_HELPER 1
static int copy_runs_with_helper(const struct runs *runs, int nontemporal);
#endif

static PyObject *copy_runs(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *src_object, *dst_object, *columns[3];
    int nontemporal, helper = 0;
    if (!PyArg_ParseTuple(args, "OOOOOp|p:copy_runs", &src_object, &dst_object, &columns[0], &columns[1],
                          &columns[2], &nontemporal, &helper))
        return NULL;
    struct runs runs;
    PyObject *result = NULL;
    if (get_runs(&runs, src_object, dst_object, columns) < 0)
        goto done;
    Py_ssize_t faulted;
    Py_BEGIN_ALLOW_THREADS
    int alone = 1;
#ifdef HAVE_HELPER
    if (helper)
        alone = copy_runs_with_helper(&runs, nontemporal);
#endif
    faulted = alone == 1 ? copy_all(&runs, nontemporal) : alone < 0 ? 0 : -1;
    Py_END_ALLOW_THREADS
    if (faulted >= 0) {
        errno = EFAULT;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release_runs(&runs);
    return result;
}

/* One run, for `guarded`. */
struct one_run {
    char *dst;
    const char *src;
    size_t nbytes;
    int nontemporal;
};

static int copy_one(void *arg)
{
    const struct one_run *run = arg;
    if (run->dst < run->src + run->nbytes && run->src < run->dst + run->nbytes)
        memmove(run->dst, run->src, run->nbytes);
    else
        copy_span(run->dst, run->src, run->nbytes, run->nontemporal);
#if HAVE_STREAMING
    if (run->nontemporal)
        _mm_sfence();
#endif
    return 0;
}

/* Below this a copy keeps the GIL: releasing and taking it back costs more than the copy. */
#define KEEP_GIL_MAX_NBYTES ((size_t)64 << 10)

static int get_u64_arg(PyObject *arg, uint64_t *value, const char *name)
{
    *value = PyLong_AsUnsignedLongLong(arg);
    if (*value == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "%s must be a non-negative int below 2**64", name);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(copy_run_doc,
"copy_run(src_address, dst_address, nbytes, nontemporal)\n--\n\n"
"copy_runs for one run of raw addresses (the caller has bounds-checked it): OSError(EFAULT) if memory\n"
"vanished under a mapping mid-copy. Large copies release the GIL.");

static PyObject *copy_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    uint64_t src, dst, nbytes;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "copy_run takes 4 arguments");
        return NULL;
    }
    if (get_u64_arg(args[0], &src, "src_address") < 0 || get_u64_arg(args[1], &dst, "dst_address") < 0 ||
        get_u64_arg(args[2], &nbytes, "nbytes") < 0)
        return NULL;
    int nontemporal = PyObject_IsTrue(args[3]);
    if (nontemporal < 0)
        return NULL;
    if (nbytes > UINT64_MAX - src || nbytes > UINT64_MAX - dst || nbytes > SIZE_MAX) {
        PyErr_SetString(PyExc_ValueError, "the run passes the end of the address space");
        return NULL;
    }
    struct one_run run = {(char *)(uintptr_t)dst, (const char *)(uintptr_t)src, (size_t)nbytes, nontemporal};
    int result;
    if (run.nbytes <= KEEP_GIL_MAX_NBYTES) {
        result = guarded(copy_one, &run, -1);
    } else {
        Py_BEGIN_ALLOW_THREADS
        result = guarded(copy_one, &run, -1);
        Py_END_ALLOW_THREADS
    }
    if (result < 0) {
        errno = EFAULT;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

struct one_word {
    const uint64_t *at;
    uint64_t value;
};

static int load_one(void *arg)
{
    struct one_word *word = arg;
    word->value = __atomic_load_n(word->at, __ATOMIC_ACQUIRE);
    return 0;
}

PyDoc_STRVAR(load_word_doc,
"load_word(address)\n--\n\n"
"The aligned 8-byte word at `address` (native order), read with acquire order under the SIGBUS guard:\n"
"OSError(EFAULT) if the memory vanished under its mapping.");

static PyObject *load_word(PyObject *module, PyObject *arg)
{
    (void)module;
    uint64_t address;
    if (get_u64_arg(arg, &address, "address") < 0)
        return NULL;
    if (address == 0 || address % 8) {
        PyErr_SetString(PyExc_ValueError, "a word's address must be non-zero and 8-byte aligned");
        return NULL;
    }
    struct one_word word = {(const uint64_t *)(uintptr_t)address, 0};
    if (guarded(load_one, &word, -1) < 0) {
        errno = EFAULT;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong(word.value);
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
/* The index is little-endian; a big-endian build leaves these out and every pull takes the Python way. */
#define HAVE_INDEX 1
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

enum { INDEX_BUSY = 1 }; /* lock_index: the lock is held by someone else */
enum { STATE_OFFSET = 12, EPOCH_OFFSET = 48, BUSY_COUNT_OFFSET = 60, ENTRY_NBYTES = 128, CACHE_FLAGS_OFFSET = 16 };
enum { STATE_OPEN = 1, NAME_LIVE = 1, CACHE_PENDING = 2, ROW_MASK_OFFSET = 64, MASK_NBYTES = 64 };
/* index_pull_key copies this much or less under the index lock instead of through a pin (a few us). */
#define HOLD_MAX_NBYTES ((uint64_t)64 << 10)

static uint32_t get_u32(const char *at) { uint32_t v; memcpy(&v, at, 4); return v; }
static uint64_t get_u64(const char *at) { uint64_t v; memcpy(&v, at, 8); return v; }
static void put_u32(char *at, uint32_t v) { memcpy(at, &v, 4); }
static void put_u64(char *at, uint64_t v) { memcpy(at, &v, 8); }

/* The whole-file OFD lock shm.index takes, without waiting: 0, INDEX_BUSY, or -1 with errno set. */
static int lock_index(int fd, short type)
{
    struct flock lock;
    memset(&lock, 0, sizeof lock);
    lock.l_type = type;
    lock.l_whence = SEEK_SET;
    if (fcntl(fd, F_OFD_SETLK, &lock) == 0)
        return 0;
    return (type == F_WRLCK && (errno == EAGAIN || errno == EACCES)) ? INDEX_BUSY : -1;
}

/* The index's writable mapping, at least `end` bytes long. */
static int get_index(PyObject *mapping, Py_buffer *view, uint64_t end)
{
    if (PyObject_GetBuffer(mapping, view, PyBUF_WRITABLE) < 0)
        return -1;
    if ((uint64_t)view->len < end) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "an entry lies past the end of the index");
        return -1;
    }
    return 0;
}

static uint64_t max3(uint64_t a, uint64_t b, uint64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* step(arg) under the index lock (taken without waiting) and the fault guard: its result, `faulted` if memory
 * vanished under a mapping meanwhile, INDEX_BUSY, or -1 with errno set. Callable without the GIL. */
static int index_locked(int fd, int (*step)(void *), void *arg, int faulted)
{
    int result = lock_index(fd, F_WRLCK);
    if (result != 0)
        return result;
    result = guarded(step, arg, faulted);
    if (lock_index(fd, F_UNLCK) < 0)
        return -1;
    return result;
}

/* vm_read_checked's results (llm_datadist/_puller/oneside.py has the rules). */
enum { VM_DONE = 0, VM_GONE = 1, VM_STALE = 2, VM_CHANGED = 3, VM_SHORT = 4 };

/* Whether the peer's end of the link's socket closed: one poll for a hang-up, as ClientLink's. */
static int hung_up(int fd)
{
    struct pollfd peer = {.fd = fd, .events = POLLRDHUP};
    int ready = poll(&peer, 1, 0);
    return ready != 0 && (ready < 0 || (peer.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)));
}

struct vm_checked {
    int fd, pid;
    const struct iovec *local, *remote;
    unsigned long count;
    uint64_t wanted;
    const uint64_t *word;
    Py_ssize_t slot;
    uint64_t generation, version;
};

static int vm_checked_step(void *arg)
{
    const struct vm_checked *call = arg;
    const uint64_t *word = call->word;
    if (hung_up(call->fd))
        return VM_GONE;
    if ((call->version != 0 && __atomic_load_n(&word[0], __ATOMIC_ACQUIRE) != call->version) ||
        __atomic_load_n(&word[call->slot], __ATOMIC_ACQUIRE) != call->generation)
        return VM_STALE;
    if (process_vm_readv(call->pid, call->local, call->count, call->remote, call->count, 0) != (ssize_t)call->wanted)
        return VM_SHORT;
    /* The copy's loads were the kernel's, done before the call returned: the word is read after them. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (hung_up(call->fd))
        return VM_GONE;
    if (__atomic_load_n(&word[call->slot], __ATOMIC_ACQUIRE) != call->generation)
        return VM_CHANGED;
    return VM_DONE;
}

PyDoc_STRVAR(vm_read_checked_doc,
"vm_read_checked(fd, pid, local_iovecs, remote_iovecs, wanted, words, slot, generation, version)\n--\n\n"
"A one-sided read of a peer's registered memory, with its checks, in one call with the GIL released: the\n"
"socket `fd` not hung up, the generation word `slot` of the mapped `words` equal to `generation` (and word\n"
"0 to `version` unless it is 0); one process_vm_readv of the struct iovec arrays into this process; then\n"
"the socket and the word again. 0 done, 1 the peer hung up, 2 stale (nothing copied), 3 the word changed\n"
"during the copy, 4 the copy moved other than `wanted` bytes (the caller redoes it the general way).");

static PyObject *vm_read_checked(PyObject *module, PyObject *args)
{
    (void)module;
    int fd, pid;
    Py_buffer local, remote, words;
    unsigned long long wanted, generation, version;
    Py_ssize_t slot;
    if (!PyArg_ParseTuple(args, "iiy*y*Ky*nKK:vm_read_checked", &fd, &pid, &local, &remote, &wanted, &words,
                          &slot, &generation, &version))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t count = local.len / (Py_ssize_t)sizeof(struct iovec);
    if (local.len != remote.len || local.len % (Py_ssize_t)sizeof(struct iovec) || count < 1 || count > 1024) {
        PyErr_SetString(PyExc_ValueError, "the iovec arrays differ, or hold no run or more than 1024");
        goto done;
    }
    if (slot < 0 || slot >= words.len / 8 || (uintptr_t)words.buf % 8) {
        PyErr_SetString(PyExc_ValueError, "the generation word lies outside the mapped words");
        goto done;
    }
    struct vm_checked call = {fd,
                              pid,
                              (const struct iovec *)local.buf,
                              (const struct iovec *)remote.buf,
                              (unsigned long)count,
                              wanted,
                              (const uint64_t *)words.buf,
                              slot,
                              generation,
                              version};
    int outcome;
    Py_BEGIN_ALLOW_THREADS
    /* A generation segment truncated under its mapping: stale (the caller's general way fails the read). */
    outcome = guarded(vm_checked_step, &call, VM_STALE);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(outcome);
done:
    PyBuffer_Release(&local);
    PyBuffer_Release(&remote);
    PyBuffer_Release(&words);
    return result;
}

/* index_pull_key: a pull of a key looked up afresh in the peer's index, checked, copied and consumed in one
 * hold of the index lock, with nothing written to the row (a copy of at most HOLD_MAX_NBYTES: nothing the
 * owner does can come between the lookup and the copy). Anything it does not handle, or finds changed, odd
 * or refused, is FRESH_STALE with nothing done: the caller takes the full way, which raises what it calls
 * for. shm/index.py has the layout; the checks are those of the full way's pin (`_puller.dataplane._pin_locked`). */
enum { FRESH_DONE = 0, FRESH_BUSY = 1, FRESH_STALE = 2, FRESH_FAULTED = 3, FRESH_PINNED = 4 };
/* index_pull_key with `copy`: copied, but the unpin found the lock busy or the row changed (the caller's full
 * unpin waits or says why); or the copy met a vanished page while pinned (the caller ends the pin as failed). */
enum { FRESH_COPIED = 5, FRESH_PIN_FAULTED = 6 };
/* index_pull_key: the plan names the link's socket (`spare` = its fd + 1) and the peer hung up on it: nothing
 * done (the caller breaks the link and says so). */
enum { FRESH_GONE = 7 };
/* index_pull_key's `copy`: copy here, with streaming stores, with the helper thread taking a share. */
enum { FRESH_COPY = 1, FRESH_COPY_STREAMING = 2, FRESH_COPY_HELPER = 4 };
enum { FRESH_CHECK_BUSY = 1, FRESH_WHOLE = 2 }; /* plan flags: v1's busy rule; the source must have exactly the tensors */
enum { NAME_NBYTES = 192, NAME_MASK_OFFSET = 64, NAME_PULLED_OFFSET = 128, NAME_CONSUMED = 2 };
enum { KIND_REQ = 1, KIND_CACHE = 3, KIND_SLOT = 5, CACHE_BLOCKS = 1, CACHE_REGISTERED = 8, CACHE_KEYS_UNPUBLISHED = 32 };
enum { SEGMENT_NAME_OFFSET = 64, SEGMENT_NAME_NBYTES = 64, ROW_RANGE_OFFSET = 40 };
#define MASK_TENSORS 512u

/* llm_datadist/_puller/fresh.py's _PLAN, "<10Q10I": what the caller asks and where things lie, packed. */
struct fresh_plan {
    uint64_t row_offset, ticket, caches_offset, names_offset, buckets_offset, key_id, model_id, src_offset,
        nbytes, dst_offset;
    uint32_t caches_cap, names_cap, buckets_cap, kind, consume, flags, tensor_start, tensor_count, batch_index,
        spare; /* the link's socket + 1, polled for a hang-up before anything else; 0: none */
};
_Static_assert(sizeof(struct fresh_plan) == 10 * 8 + 10 * 4, "the fresh plan is packed");
/* The peer's segments the caller mapped, each its name as the index's cache entries hold it, then where it is
 * mapped here and its size (uint64 each): llm_datadist/_puller/fresh.py's _SEGMENT. */
enum { FRESH_SEGMENT_NBYTES = SEGMENT_NAME_NBYTES + 16 };

struct fresh_call {
    char *index;
    uint64_t index_nbytes;
    const struct fresh_plan *plan;
    const uint64_t *dst_addrs;
    const char *segments;
    uint64_t segment_count;
    uint64_t *src_out; /* a pin instead of a copy: each tensor's source address goes here */
};

static uint64_t key_hash(uint64_t kind, uint64_t key_id, uint64_t model_id)
{
    uint64_t h = kind * 0x9E3779B97F4A7C15ull + key_id * 0xBF58476D1CE4E5B9ull + model_id * 0x94D049BB133111EBull;
    h ^= h >> 31;
    h *= 0xD6E8FEB86659FD93ull;
    h ^= h >> 32;
    return h;
}

/* The offset of live name (kind, key_id, model_id), or 0 when there is none or the chain is odd. */
static uint64_t fresh_lookup(const struct fresh_call *call, uint32_t kind, uint64_t key_id, uint64_t model_id)
{
    const struct fresh_plan *plan = call->plan;
    uint64_t buckets = plan->buckets_cap, bucket = key_hash(kind, key_id, model_id) % buckets;
    for (uint64_t probe = 0; probe < buckets; probe++) {
        uint32_t stored = get_u32(call->index + plan->buckets_offset + 4 * bucket);
        if (stored == 0 || stored > plan->names_cap)
            return 0;
        uint64_t offset = plan->names_offset + (uint64_t)(stored - 1) * NAME_NBYTES;
        const char *name = call->index + offset;
        if (get_u32(name) == NAME_LIVE && get_u32(name + 4) == kind && get_u64(name + 8) == key_id &&
            get_u64(name + 16) == model_id)
            return offset;
        bucket = (bucket + 1) % buckets;
    }
    return 0;
}

static int mask_has(const char *mask, uint32_t start, uint32_t count)
{
    for (uint32_t t = start; t < start + count; t++)
        if (!((unsigned char)mask[t / 8] & (1u << (t % 8))))
            return 0;
    return 1;
}

static int mask_empty(const char *mask)
{
    for (unsigned i = 0; i < MASK_TENSORS / 8; i++)
        if (mask[i])
            return 0;
    return 1;
}

/* Under the lock and the fault guard: look up, check, copy, consume. */
static int fresh_locked(void *arg)
{
    const struct fresh_call *call = arg;
    const struct fresh_plan *plan = call->plan;
    char *index = call->index;
    if (get_u32(index + STATE_OFFSET) != STATE_OPEN)
        return FRESH_STALE;
    if ((plan->flags & FRESH_CHECK_BUSY) && get_u32(index + BUSY_COUNT_OFFSET) != 0)
        return FRESH_STALE;
    const char *row = index + plan->row_offset;
    if (get_u64(row) != plan->ticket || get_u32(row + 8) != 0)
        return FRESH_STALE;
    uint64_t name_offset = fresh_lookup(call, plan->kind, plan->key_id, plan->model_id);
    if (name_offset == 0)
        return FRESH_STALE;
    char *name = index + name_offset;
    uint32_t cache_slot = get_u32(name + 24), batch_slot = get_u32(name + 28);
    uint64_t generation = get_u64(name + 32);
    if (cache_slot >= plan->caches_cap)
        return FRESH_STALE;
    const char *cache = index + plan->caches_offset + (uint64_t)cache_slot * ENTRY_NBYTES;
    uint64_t tensor_nbytes = get_u64(cache + 40), pitch = get_u64(cache + 32), base = get_u64(cache + 24);
    uint64_t seg_nbytes = get_u64(cache + 56);
    uint32_t flags = get_u32(cache + 16), batch = get_u32(cache + 20), count = get_u32(cache + 48);
    if (generation == 0 || get_u64(cache) != generation || (flags & CACHE_REGISTERED) || batch == 0 || count == 0 ||
        tensor_nbytes == 0 || tensor_nbytes % batch || pitch < tensor_nbytes || batch_slot >= batch)
        return FRESH_STALE;
    const char *seg_base = NULL;
    for (uint64_t k = 0; k < call->segment_count && seg_base == NULL; k++) {
        const char *mapped = call->segments + k * FRESH_SEGMENT_NBYTES;
        if (memcmp(cache + SEGMENT_NAME_OFFSET, mapped, SEGMENT_NAME_NBYTES) == 0 &&
            seg_nbytes <= get_u64(mapped + SEGMENT_NAME_NBYTES + 8))
            seg_base = (const char *)(uintptr_t)get_u64(mapped + SEGMENT_NAME_NBYTES);
    }
    if (seg_base == NULL)
        return FRESH_STALE; /* a segment the caller has not mapped (or at another size): the full way maps it */
    if (seg_nbytes < tensor_nbytes || (count > 1 && pitch > (seg_nbytes - tensor_nbytes) / (count - 1)) ||
        base > seg_nbytes - tensor_nbytes - pitch * (count - 1))
        return FRESH_STALE; /* the tensors pass the segment's end: the full way says the entry is corrupt */
    uint32_t start = plan->tensor_start, want = plan->tensor_count;
    uint64_t slot_nbytes = tensor_nbytes / batch;
    if (want == 0 || start > count || want > count - start || ((plan->flags & FRESH_WHOLE) && want != count) ||
        plan->src_offset > slot_nbytes ||
        plan->nbytes > slot_nbytes - plan->src_offset)
        return FRESH_STALE;
    /* What the pull consumes: a req key itself; by cache id, the req key bound to the slot, if any. */
    char *consumed = plan->consume && plan->kind == KIND_REQ ? name : NULL;
    if (plan->kind == KIND_CACHE) {
        if ((flags & CACHE_BLOCKS) || plan->batch_index >= batch)
            return FRESH_STALE; /* refused by v1: the full way says why */
        batch_slot = plan->batch_index;
        uint64_t alias = fresh_lookup(call, KIND_SLOT, plan->key_id, batch_slot);
        if (alias != 0 && plan->consume) {
            uint32_t target = get_u32(index + alias + 40);
            if (target == 0 || target > plan->names_cap)
                return FRESH_STALE;
            char *bound = index + plan->names_offset + (uint64_t)(target - 1) * NAME_NBYTES;
            if (get_u32(bound + 24) == cache_slot && get_u64(bound + 32) == generation)
                consumed = bound;
        } else if (plan->consume && (flags & CACHE_KEYS_UNPUBLISHED)) {
            return FRESH_STALE; /* the slot's req key may be one the index does not hold: the owner consumes it */
        }
    }
    if (consumed != NULL && (start + want > MASK_TENSORS || !mask_has(consumed + NAME_MASK_OFFSET, start, want)))
        return FRESH_STALE; /* some of it is reserved or pulled by another pull: the full way credits */
    const char *src = seg_base + base + batch_slot * slot_nbytes + plan->src_offset;
    if (call->src_out != NULL) {
        /* The full way's pin (`_puller.dataplane._pin_locked`): reserve what we pull of the key, name the key and
         * the cache in our row (the owner frees neither while it does), and leave the copy to the caller. */
        uint64_t name_number = consumed ? (uint64_t)(consumed - index - plan->names_offset) / NAME_NBYTES + 1 : 0;
        char *pin = index + plan->row_offset;
        memset(pin + ROW_MASK_OFFSET, 0, MASK_NBYTES);
        if (consumed) {
            for (uint32_t t = start; t < start + want; t++) {
                consumed[NAME_MASK_OFFSET + t / 8] &= (char)~(1u << (t % 8));
                pin[ROW_MASK_OFFSET + t / 8] |= (char)(1u << (t % 8));
            }
            if (mask_empty(consumed + NAME_MASK_OFFSET)) {
                put_u32(consumed, NAME_CONSUMED);
                put_u64(index + EPOCH_OFFSET, get_u64(index + EPOCH_OFFSET) + 1);
            }
        }
        put_u32(pin + 8, 1);
        put_u32(pin + 12, cache_slot);
        put_u64(pin + 16, generation);
        put_u32(pin + 24, (uint32_t)name_number);
        put_u32(pin + ROW_RANGE_OFFSET, start);
        put_u32(pin + ROW_RANGE_OFFSET + 4, want);
        for (uint32_t i = 0; i < want; i++)
            call->src_out[i] = (uint64_t)(uintptr_t)(src + (uint64_t)(start + i) * pitch);
        return FRESH_PINNED;
    }
    for (uint32_t i = 0; i < want; i++) {
        char *dst = (char *)(uintptr_t)(call->dst_addrs[i] + plan->dst_offset);
        memcpy(dst, src + (uint64_t)(start + i) * pitch, plan->nbytes); /* small: left in cache for its reader */
    }
    if (consumed) {
        for (uint32_t t = start; t < start + want; t++) {
            consumed[NAME_MASK_OFFSET + t / 8] &= (char)~(1u << (t % 8));
            consumed[NAME_PULLED_OFFSET + t / 8] |= (char)(1u << (t % 8));
        }
        if (mask_empty(consumed + NAME_MASK_OFFSET)) {
            put_u32(consumed, NAME_CONSUMED); /* every tensor pulled: the owner reclaims it at its next look */
            put_u64(index + EPOCH_OFFSET, get_u64(index + EPOCH_OFFSET) + 1);
        }
    }
    return FRESH_DONE;
}

/* The copy helper: one thread of the process's own that takes a share of a pinned copy. A hand-off to a
 * Python copy thread costs 70-150 us on a small VM (a futex wake of a sleeping thread, the GIL), more than
 * a 2 MiB copy gains from the second core; this thread stays awake for HELPER_SPIN_NS after each copy
 * (yielding its CPU to whoever else may run on it), so that the copies of a burst of requests find it
 * awake, and sleeps on a futex after. The copy is cut into chunks that both threads claim from one
 * counter: the caller starts at once and never waits for the helper to wake, only for a chunk the helper
 * claimed to end (sleeping on a futex after 20 us, so that a preempted helper may be moved to its CPU). One
 * copy at a time (a second caller copies alone); the job lives in static storage and its fields are
 * written before the claim counter opens it (release) and read after a claim (acquire); the caller returns
 * only once every claimed chunk is done. A page that vanishes mid-chunk (SIGBUS, SIGSEGV) stops the copy:
 * the thread that met it claims the rest without copying, and the job is marked faulted. */
#define HELPER_CHUNK_NBYTES ((uint64_t)256 << 10)
#define HELPER_MIN_NBYTES ((uint64_t)512 << 10)
#define HELPER_MIN_CHUNKS 16
#define HELPER_SPIN_NS 200000ull
#define HELPER_CLOSED (UINT64_MAX / 2)

/* Run r moves len(r) bytes from src_base + src[r] to dst_base + dst[r] + dst_offset, len(r) being
 * lengths[r], or nbytes for every run when lengths is NULL. A chunk is a HELPER_CHUNK_NBYTES piece of one run
 * (chunks_per_run > 1) or runs_per_chunk whole runs (short runs, one claim for several). */
static struct {
    const uint64_t *src, *dst, *lengths;
    uint64_t src_base, dst_base, dst_offset, nbytes, count, chunks_per_run, runs_per_chunk, total;
    int nontemporal;
    _Atomic uint64_t next, done;
    _Atomic int faulted;
    _Atomic uint32_t finished; /* a futex word: 1 once every chunk is done */
    _Atomic int caller_sleeps;
} helper_job = {.next = HELPER_CLOSED};
static pthread_mutex_t helper_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uint32_t helper_word;
static _Atomic int helper_sleeping;
static pid_t helper_pid; /* the process the helper was started in (none in a forked child) */

static uint64_t monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
}

/* One chunk more is done (copied or given up): the last one wakes a caller that sleeps waiting for it. */
static void chunk_done(void)
{
    if (atomic_fetch_add(&helper_job.done, 1) + 1 != helper_job.total)
        return;
    atomic_store(&helper_job.finished, 1);
    if (atomic_load(&helper_job.caller_sleeps))
        syscall(SYS_futex, &helper_job.finished, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

struct chunk_worker {
    volatile int busy; /* a chunk claimed and not yet counted done */
};

static int copy_chunks(void *arg)
{
    struct chunk_worker *worker = arg;
    for (;;) {
        uint64_t c = atomic_fetch_add_explicit(&helper_job.next, 1, memory_order_acq_rel);
        if (c >= helper_job.total)
            break;
        worker->busy = 1;
        uint64_t first, end, from = 0;
        if (helper_job.runs_per_chunk > 1) {
            first = c * helper_job.runs_per_chunk;
            end = first + helper_job.runs_per_chunk < helper_job.count ? first + helper_job.runs_per_chunk
                                                                       : helper_job.count;
        } else {
            first = c / helper_job.chunks_per_run, end = first + 1;
            from = (c % helper_job.chunks_per_run) * HELPER_CHUNK_NBYTES;
        }
        struct copier copier = {.nontemporal = helper_job.nontemporal};
        for (uint64_t r = first; r < end; r++) {
            uint64_t length = helper_job.lengths ? helper_job.lengths[r] : helper_job.nbytes;
            if (from >= length)
                continue; /* a run shorter than the longest: this chunk of it is empty */
            uint64_t n = length - from < HELPER_CHUNK_NBYTES || helper_job.runs_per_chunk > 1 ? length - from
                                                                                               : HELPER_CHUNK_NBYTES;
            char *dst = (char *)(uintptr_t)(helper_job.dst_base + helper_job.dst[r] + helper_job.dst_offset + from);
            const char *src = (const char *)(uintptr_t)(helper_job.src_base + helper_job.src[r] + from);
            copy_add(&copier, dst, src, n);
        }
        copy_end(&copier);
#if HAVE_STREAMING
        if (helper_job.nontemporal)
            _mm_sfence(); /* the streaming stores are visible before the chunk counts as done */
#endif
        worker->busy = 0;
        chunk_done();
    }
    return 0;
}

/* This thread's share of the job, under the fault guard. */
static void work_on_job(void)
{
    struct chunk_worker worker = {0};
    if (guarded(copy_chunks, &worker, -1) == 0)
        return;
    atomic_store(&helper_job.faulted, 1);
    if (worker.busy)
        chunk_done();
    while (atomic_fetch_add_explicit(&helper_job.next, 1, memory_order_acq_rel) < helper_job.total)
        chunk_done(); /* the rest, not copied */
}

/* `arg`: the job word as its creator read it, before it posts the job it was started for: read here, the
 * word may already count that job, which the helper would then leave to the caller alone. */
static void *helper_main(void *arg)
{
    uint32_t seen = (uint32_t)(uintptr_t)arg;
    for (;;) {
        uint64_t until = monotonic_ns() + HELPER_SPIN_NS;
        while (atomic_load_explicit(&helper_word, memory_order_acquire) == seen) {
            if (monotonic_ns() < until) {
                /* Yield, not pause: on a small machine the caller may be runnable on this very CPU. */
                sched_yield();
                continue;
            }
            atomic_store(&helper_sleeping, 1);
            if (atomic_load(&helper_word) == seen)
                syscall(SYS_futex, &helper_word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_store(&helper_sleeping, 0);
            until = monotonic_ns() + HELPER_SPIN_NS;
        }
        seen = atomic_load(&helper_word);
        work_on_job();
    }
    return NULL;
}

/* The helper of this process, started if it is not (1), or 0 when there is none to be had. */
static int helper_ready(void)
{
    pid_t pid = getpid();
    if (helper_pid == pid)
        return 1;
    pthread_attr_t attr;
    pthread_t thread;
    if (pthread_attr_init(&attr) != 0)
        return 0;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 << 10);
    /* Every signal but the fault guard's is the program's main thread's: the helper starts with them blocked. */
    sigset_t all, previous;
    sigfillset(&all);
    sigdelset(&all, SIGBUS);
    sigdelset(&all, SIGSEGV);
    pthread_sigmask(SIG_BLOCK, &all, &previous);
    uint32_t seen = atomic_load(&helper_word);
    int started = pthread_create(&thread, &attr, helper_main, (void *)(uintptr_t)seen) == 0;
    pthread_sigmask(SIG_SETMASK, &previous, NULL);
    pthread_attr_destroy(&attr);
    if (started)
        helper_pid = pid;
    return started;
}

/* The runs of a job (see helper_job), none overlapping its own destination. */
struct job_runs {
    const uint64_t *src, *dst, *lengths;
    uint64_t src_base, dst_base, dst_offset, nbytes, count, longest, total_nbytes;
};

/* Copy `runs` with the helper when it is worth it: 0, -1 when a page vanished under a mapping mid-copy, 1
 * when the caller must copy alone (nothing copied). Without the GIL. */
static int copy_job_with_helper(const struct job_runs *runs, int nontemporal)
{
    if (runs->total_nbytes < HELPER_MIN_NBYTES || runs->longest == 0 || pthread_mutex_trylock(&helper_lock) != 0)
        return 1; /* the caller copies alone */
    if (!helper_ready()) {
        pthread_mutex_unlock(&helper_lock);
        return 1;
    }
    helper_job.src = runs->src, helper_job.dst = runs->dst, helper_job.lengths = runs->lengths;
    helper_job.src_base = runs->src_base, helper_job.dst_base = runs->dst_base;
    helper_job.dst_offset = runs->dst_offset, helper_job.nbytes = runs->nbytes, helper_job.count = runs->count;
    if (runs->longest >= HELPER_CHUNK_NBYTES) {
        helper_job.chunks_per_run = (runs->longest + HELPER_CHUNK_NBYTES - 1) / HELPER_CHUNK_NBYTES;
        helper_job.runs_per_chunk = 1;
        helper_job.total = helper_job.chunks_per_run * runs->count;
    } else {
        /* Several short runs a claim, but at least HELPER_MIN_CHUNKS claims: the two threads end together. */
        uint64_t most = runs->count / HELPER_MIN_CHUNKS;
        helper_job.chunks_per_run = 1;
        helper_job.runs_per_chunk = HELPER_CHUNK_NBYTES / runs->longest;
        if (helper_job.runs_per_chunk > most)
            helper_job.runs_per_chunk = most > 1 ? most : 1;
        helper_job.total = (runs->count + helper_job.runs_per_chunk - 1) / helper_job.runs_per_chunk;
    }
    helper_job.nontemporal = nontemporal;
    atomic_store(&helper_job.faulted, 0);
    atomic_store(&helper_job.done, 0);
    atomic_store(&helper_job.finished, 0);
    atomic_store(&helper_job.caller_sleeps, 0);
    atomic_store_explicit(&helper_job.next, 0, memory_order_release); /* open: the fields above are set */
    atomic_fetch_add_explicit(&helper_word, 1, memory_order_release);
    if (atomic_load(&helper_sleeping))
        syscall(SYS_futex, &helper_word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    work_on_job();
    /* The helper ends the chunk it claimed (microseconds). If it takes longer it was preempted: sleep, so
     * that this CPU goes idle and the scheduler may move the helper here, and let its last chunk wake us. */
    uint64_t spin_until = monotonic_ns() + 20000;
    while (atomic_load(&helper_job.done) < helper_job.total) {
        if (monotonic_ns() < spin_until) {
#if HAVE_STREAMING
            _mm_pause();
#endif
            continue;
        }
        atomic_store(&helper_job.caller_sleeps, 1);
        struct timespec most = {0, 1000000}; /* a missed wake costs at most this */
        if (atomic_load(&helper_job.done) < helper_job.total)
            syscall(SYS_futex, &helper_job.finished, FUTEX_WAIT_PRIVATE, 0, &most, NULL, 0);
    }
    atomic_store(&helper_job.next, HELPER_CLOSED);
    int faulted = atomic_load(&helper_job.faulted);
    pthread_mutex_unlock(&helper_lock);
    return faulted ? -1 : 0;
}

/* Copy tensor i from src[i] to dst[i] + dst_offset, nbytes each, with the helper when it is worth it: as
 * copy_job_with_helper. */
static int copy_with_helper(const uint64_t *src, const uint64_t *dst, uint64_t dst_offset, uint64_t nbytes,
                            uint32_t count, int nontemporal)
{
    struct job_runs runs = {src, dst, NULL, 0, 0, dst_offset, nbytes, count, nbytes, nbytes * count};
    return copy_job_with_helper(&runs, nontemporal);
}

/* copy_runs' runs with the helper: as copy_job_with_helper (1 too when a run overlaps its destination). */
static int copy_runs_with_helper(const struct runs *runs, int nontemporal)
{
    struct job_runs job = {runs->src_offsets, runs->dst_offsets, runs->lengths, runs->src_base, runs->dst_base,
                           0, 0, (uint64_t)runs->count, 0, 0};
    for (Py_ssize_t i = 0; i < runs->count; i++) {
        uint64_t n = runs->lengths[i];
        const char *dst = (const char *)(uintptr_t)(runs->dst_base + runs->dst_offsets[i]);
        const char *src = (const char *)(uintptr_t)(runs->src_base + runs->src_offsets[i]);
        if (dst < src + n && src < dst + n)
            return 1; /* moved as memmove does, alone */
        job.longest = n > job.longest ? n : job.longest;
        job.total_nbytes += n;
    }
    return copy_job_with_helper(&job, nontemporal);
}

static int fresh_unpin_locked(void *arg);

/* The copy of what a fresh pin pinned: tensor i from src[i] to dst[i] + dst_offset, nbytes each. */
struct pinned_copy {
    const uint64_t *src, *dst;
    uint64_t dst_offset, nbytes;
    uint32_t count;
    int nontemporal;
};

static int pinned_copy_step(void *arg)
{
    const struct pinned_copy *copy = arg;
    struct copier copier = {.nontemporal = copy->nontemporal};
    for (uint32_t i = 0; i < copy->count; i++) {
        char *dst = (char *)(uintptr_t)(copy->dst[i] + copy->dst_offset);
        copy_add(&copier, dst, (const char *)(uintptr_t)copy->src[i], copy->nbytes);
    }
    copy_end(&copier);
#if HAVE_STREAMING
    if (copy->nontemporal)
        _mm_sfence();
#endif
    return 0;
}

PyDoc_STRVAR(index_pull_key_doc,
"index_pull_key(mapping, fd, plan, dst_addrs, segments, src_out, copy)\n--\n\n"
"A pull of a key looked up afresh, in one hold of the index lock (GIL released): 0 done, 1 the lock is\n"
"busy, 2 stale (not handled here: nothing done), 3 faulted (memory vanished mid-copy: the key is left\n"
"as it was), 7 the peer hung up on the socket the plan names (nothing done). plan: llm_datadist._puller.fresh's plan; dst_addrs: one native uint64 address per tensor;\n"
"segments: the peer's segments mapped here (llm_datadist._puller.fresh's table). src_out None: the copy is made\n"
"under the lock, at most 64 KiB in all. src_out a writable buffer of one uint64 per tensor: any size, the\n"
"key pinned through the row, each tensor's source address written to src_out; then with copy 0, 4\n"
"returned (the caller copies, then index_unpin_key); with copy 1 (| 2: streaming stores, | 4: the helper\n"
"thread takes a share), the copy and the unpin made here with the lock free between: 0 done, 5 copied\n"
"but not unpinned (the lock busy or the row changed: the caller unpins), 6 a page vanished mid-copy\n"
"(still pinned: the caller ends the pin as a failed pull's).");

static PyObject *index_pull_key(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "index_pull_key takes 7 arguments");
        return NULL;
    }
    int pin = args[5] != Py_None;
    long fd = PyLong_AsLong(args[1]);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    long copy = PyLong_AsLong(args[6]);
    if (copy == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer plan_view, addrs_view, segments_view, out_view = {0}, view;
    if (PyObject_GetBuffer(args[2], &plan_view, PyBUF_SIMPLE) < 0)
        return NULL;
    struct fresh_plan plan;
    if (plan_view.len != (Py_ssize_t)sizeof plan) {
        PyBuffer_Release(&plan_view);
        PyErr_SetString(PyExc_ValueError, "a fresh plan is 120 bytes");
        return NULL;
    }
    memcpy(&plan, plan_view.buf, sizeof plan);
    PyBuffer_Release(&plan_view);
    if (PyObject_GetBuffer(args[3], &addrs_view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(args[4], &segments_view, PyBUF_SIMPLE) < 0)
        goto release_addrs;
    if (pin && PyObject_GetBuffer(args[5], &out_view, PyBUF_WRITABLE) < 0)
        goto release_segments;
    if (addrs_view.len != (Py_ssize_t)(8 * (uint64_t)plan.tensor_count) ||
        (pin && out_view.len != addrs_view.len) || plan.buckets_cap == 0 ||
        segments_view.len % FRESH_SEGMENT_NBYTES != 0 ||
        (!pin && (plan.tensor_count > HOLD_MAX_NBYTES || plan.nbytes * plan.tensor_count > HOLD_MAX_NBYTES))) {
        PyErr_SetString(PyExc_ValueError,
                        "a fresh pull names one address per tensor (and one source slot when it pins), whole "
                        "segment entries, and at most 64 KiB in all unless it pins");
        goto release_out;
    }
    /* Every region the plan names must lie in the mapping (the entries read inside are bounded by the caps). */
    uint64_t end = max3(plan.row_offset + ENTRY_NBYTES, plan.caches_offset + (uint64_t)plan.caches_cap * ENTRY_NBYTES,
                        plan.names_offset + (uint64_t)plan.names_cap * NAME_NBYTES);
    if (plan.buckets_offset + 4 * (uint64_t)plan.buckets_cap > end)
        end = plan.buckets_offset + 4 * (uint64_t)plan.buckets_cap;
    if (get_index(args[0], &view, end) < 0)
        goto release_out;
    struct fresh_call call = {view.buf,
                              (uint64_t)view.len,
                              &plan,
                              addrs_view.buf,
                              segments_view.buf,
                              (uint64_t)segments_view.len / FRESH_SEGMENT_NBYTES,
                              pin ? out_view.buf : NULL};
    int outcome, error = 0;
    Py_BEGIN_ALLOW_THREADS
    if (plan.spare != 0 && hung_up((int)plan.spare - 1))
        outcome = FRESH_GONE; /* a dead owner's index is never read */
    else
        outcome = index_locked((int)fd, fresh_locked, &call, FRESH_FAULTED);
    if (outcome == FRESH_PINNED && copy) {
        /* Copy with the lock free (the pin holds the cache and the key), then unpin, as index_unpin_key. */
        int streaming = (copy & FRESH_COPY_STREAMING) != 0;
        struct pinned_copy pinned = {call.src_out, call.dst_addrs, plan.dst_offset, plan.nbytes, plan.tensor_count,
                                     streaming};
        int copied = 1;
        if (copy & FRESH_COPY_HELPER)
            copied = copy_with_helper(call.src_out, call.dst_addrs, plan.dst_offset, plan.nbytes, plan.tensor_count,
                                      streaming);
        if (copied == 1)
            copied = guarded(pinned_copy_step, &pinned, -1);
        if (copied < 0) {
            outcome = FRESH_PIN_FAULTED;
        } else {
            /* Busy, no lock to be had, or the row changed: the caller's unpin waits or says why. */
            int unpinned = index_locked((int)fd, fresh_unpin_locked, &call, FRESH_STALE);
            outcome = unpinned == FRESH_DONE ? FRESH_DONE : FRESH_COPIED;
        }
    }
    error = errno;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (outcome < 0) {
        errno = error;
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        result = PyLong_FromLong(outcome);
    }
release_out:
    if (pin)
        PyBuffer_Release(&out_view);
release_segments:
    PyBuffer_Release(&segments_view);
release_addrs:
    PyBuffer_Release(&addrs_view);
    return result;
}

/* Under the lock and the fault guard: end the pin index_pull_key took through the row, after a copy that
 * went well (`_puller.dataplane._unpin_locked` with ok): what it pulled is credited to the key it names, whoever
 * reserved it. Anything unexpected is FRESH_STALE with nothing done: the caller's full unpin says why. */
static int fresh_unpin_locked(void *arg)
{
    const struct fresh_call *call = arg;
    const struct fresh_plan *plan = call->plan;
    char *index = call->index, *row = index + plan->row_offset;
    if (get_u64(row) != plan->ticket || get_u32(row + 8) == 0)
        return FRESH_STALE;
    uint32_t cache_slot = get_u32(row + 12), name_number = get_u32(row + 24);
    uint32_t start = get_u32(row + ROW_RANGE_OFFSET), want = get_u32(row + ROW_RANGE_OFFSET + 4);
    uint64_t generation = get_u64(row + 16);
    if (cache_slot >= plan->caches_cap || name_number > plan->names_cap ||
        (name_number && (start > MASK_TENSORS || want > MASK_TENSORS - start)))
        return FRESH_STALE;
    if (name_number) {
        char *name = index + plan->names_offset + (uint64_t)(name_number - 1) * NAME_NBYTES;
        uint32_t state = get_u32(name);
        if ((state == NAME_LIVE || state == NAME_CONSUMED) && get_u32(name + 4) == KIND_REQ &&
            get_u32(name + 24) == cache_slot && get_u64(name + 32) == generation &&
            !mask_has(name + NAME_PULLED_OFFSET, start, want)) {
            for (uint32_t t = start; t < start + want; t++) {
                name[NAME_MASK_OFFSET + t / 8] &= (char)~(1u << (t % 8));
                name[NAME_PULLED_OFFSET + t / 8] |= (char)(1u << (t % 8));
            }
            put_u32(name, mask_empty(name + NAME_MASK_OFFSET) ? NAME_CONSUMED : NAME_LIVE);
        }
    }
    const char *cache = index + plan->caches_offset + (uint64_t)cache_slot * ENTRY_NBYTES;
    if (name_number || (get_u32(cache + CACHE_FLAGS_OFFSET) & CACHE_PENDING))
        put_u64(index + EPOCH_OFFSET, get_u64(index + EPOCH_OFFSET) + 1);
    memset(row + 8, 0, 20); /* state, cache slot, generation, name + 1 */
    return FRESH_DONE;
}

PyDoc_STRVAR(index_unpin_key_doc,
"index_unpin_key(mapping, fd, plan)\n--\n\n"
"End the pin index_pull_key took with src_out, after a copy that went well (GIL released): 0 done, 1 the\n"
"lock is busy, 2 stale (the row is not as the pin left it: nothing done; the caller's full unpin says\n"
"why). plan: the same plan.");

static PyObject *index_unpin_key(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *mapping;
    int fd;
    Py_buffer plan_view, view;
    if (!PyArg_ParseTuple(args, "Oiy*:index_unpin_key", &mapping, &fd, &plan_view))
        return NULL;
    struct fresh_plan plan;
    int ok = plan_view.len == (Py_ssize_t)sizeof plan;
    if (ok)
        memcpy(&plan, plan_view.buf, sizeof plan);
    PyBuffer_Release(&plan_view);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "a fresh plan is 120 bytes");
        return NULL;
    }
    uint64_t end = max3(plan.row_offset + ENTRY_NBYTES, plan.caches_offset + (uint64_t)plan.caches_cap * ENTRY_NBYTES,
                        plan.names_offset + (uint64_t)plan.names_cap * NAME_NBYTES);
    if (get_index(mapping, &view, end) < 0)
        return NULL;
    struct fresh_call call = {view.buf, (uint64_t)view.len, &plan, NULL, NULL, 0, NULL};
    int outcome, error = 0;
    Py_BEGIN_ALLOW_THREADS
    outcome = index_locked(fd, fresh_unpin_locked, &call, FRESH_STALE);
    error = errno;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (outcome < 0) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(outcome);
}
#endif

PyDoc_STRVAR(count_transfer_doc,
"count_transfer(address, kind, timing, buckets, nbytes, runs, ns)\n--\n\n"
"shm.stats: one transfer into a thread's own row of 8-byte words at `address` (a mapping the caller keeps\n"
"open): words kind, kind+1, kind+2 += 1, nbytes, runs; word timing += ns; word timing+2+b += 1, b the\n"
"histogram bucket of ns (the bit length of its microseconds, at most buckets-1). Plain adds: the row is\n"
"this thread's alone.");

static PyObject *count_transfer(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "count_transfer takes 7 arguments");
        return NULL;
    }
    uint64_t values[7];
    for (Py_ssize_t i = 0; i < 7; i++) {
        values[i] = PyLong_AsUnsignedLongLong(args[i]);
        if (values[i] == (uint64_t)-1 && PyErr_Occurred())
            return NULL;
    }
    uint64_t *words = (uint64_t *)(uintptr_t)values[0];
    uint64_t kind = values[1], timing = values[2], buckets = values[3], ns = values[6];
    if (words == NULL || buckets == 0) {
        PyErr_SetString(PyExc_ValueError, "count_transfer: no row, or no bucket");
        return NULL;
    }
    uint64_t us = ns / 1000, bucket = 0;
    while (us) {
        bucket++;
        us >>= 1;
    }
    if (bucket >= buckets)
        bucket = buckets - 1;
    words[kind] += 1;
    words[kind + 1] += values[4];
    words[kind + 2] += values[5];
    words[timing] += ns;
    words[timing + 2 + bucket] += 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_runs", copy_runs, METH_VARARGS, copy_runs_doc},
    {"copy_run", (PyCFunction)(void (*)(void))copy_run, METH_FASTCALL, copy_run_doc},
    {"load_word", load_word, METH_O, load_word_doc},
    {"count_transfer", (PyCFunction)(void (*)(void))count_transfer, METH_FASTCALL, count_transfer_doc},
#ifdef HAVE_INDEX
    {"index_pull_key", (PyCFunction)(void (*)(void))index_pull_key, METH_FASTCALL, index_pull_key_doc},
    {"index_unpin_key", index_unpin_key, METH_VARARGS, index_unpin_key_doc},
    {"vm_read_checked", vm_read_checked, METH_VARARGS, vm_read_checked_doc},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_copykernel",
    .m_doc = "Copies lists of byte runs with the GIL released; repeats pins in a published index.",
    .m_size = -1,
    .m_methods = methods,
};

#ifdef HAVE_INDEX
/* A child forked while another thread held one of these locks would find it held for ever. */
static void reset_after_fork(void)
{
    pthread_mutex_init(&guard_lock, NULL);
    pthread_mutex_init(&helper_lock, NULL);
    atomic_store(&helper_job.next, HELPER_CLOSED);
    atomic_store(&helper_sleeping, 0);
}
#endif

PyMODINIT_FUNC PyInit__copykernel(void)
{
#ifdef HAVE_INDEX
    static int registered;
    if (!registered && pthread_atfork(NULL, NULL, reset_after_fork) == 0)
        registered = 1;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", HAVE_STREAMING) < 0)
        Py_CLEAR(m);
    return m;
}
