/* The optional copy kernel: one call copies a list of (src, dst, nbytes) runs with the GIL released, with
 * plain memcpy or with non-temporal (streaming) stores on x86-64. No threads here: the caller splits the
 * runs over its own copy threads. Addresses are raw: the caller has bounds-checked every run against
 * memory it maps. A page that vanishes under a mapping mid-copy (a segment truncated by its owner) raises
 * OSError(EFAULT) instead of killing the process with SIGBUS. Built by setup.py when a compiler is
 * present (optional); llm_datadist._copy falls back to numpy without it. */
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
/* Stream 64 bytes per iteration into 16-byte-aligned destinations; memcpy the unaligned head and tail. */
static void copy_streaming(char *dst, const char *src, size_t nbytes)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > nbytes)
        head = nbytes;
    memcpy(dst, src, head);
    dst += head, src += head, nbytes -= head;
    for (; nbytes >= 64; nbytes -= 64, src += 64, dst += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, nbytes);
}
#endif

/* SIGBUS during a copy jumps back to copy_runs on the faulting thread. The handler is installed while any
 * thread copies (counted under a mutex) and the previous one restored after, so that faulthandler and
 * others keep SIGBUS outside our copies; a SIGBUS elsewhere meanwhile goes to the previous handler. */
static pthread_mutex_t guard_lock = PTHREAD_MUTEX_INITIALIZER;
static int guard_users;
static struct sigaction guard_previous;
/* initial-exec: reading it in the handler must not allocate (a dlopen'ed module's TLS may otherwise). */
static __thread sigjmp_buf *guard_jump __attribute__((tls_model("initial-exec")));

static void on_sigbus(int signum, siginfo_t *info, void *context)
{
    sigjmp_buf *jump = guard_jump;
    int fault = info->si_code > 0; /* raised by the kernel for an access, not sent by a process */
    if (jump != NULL && fault) {
        guard_jump = NULL;
        siglongjmp(*jump, 1);
    }
    /* Not our copy: do what the previous disposition would have done. */
    if (guard_previous.sa_flags & SA_SIGINFO) {
        guard_previous.sa_sigaction(signum, info, context);
    } else if (guard_previous.sa_handler != SIG_DFL && guard_previous.sa_handler != SIG_IGN) {
        guard_previous.sa_handler(signum);
    } else if (fault || guard_previous.sa_handler == SIG_DFL) {
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
        action.sa_sigaction = on_sigbus;
        action.sa_flags = SA_SIGINFO;
        sigemptyset(&action.sa_mask);
        sigaction(SIGBUS, &action, &guard_previous);
    }
    pthread_mutex_unlock(&guard_lock);
}

static void guard_leave(void)
{
    pthread_mutex_lock(&guard_lock);
    if (--guard_users == 0)
        sigaction(SIGBUS, &guard_previous, NULL);
    pthread_mutex_unlock(&guard_lock);
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
"copy_runs(src_base, dst_base, src_offsets, dst_offsets, lengths, nontemporal)\n--\n\n"
"Copy run i: lengths[i] bytes from address src_base + src_offsets[i] to dst_base + dst_offsets[i], in\n"
"order, with the GIL released; streaming stores when nontemporal (x86-64 only; memcpy elsewhere). The\n"
"columns are 1-D contiguous uint64 buffers of equal length. A run whose two ranges overlap is moved as\n"
"memmove does. TypeError/ValueError on bad arguments or a run past 2**64 (nothing copied then);\n"
"OSError(EFAULT) when memory vanished under a mapping mid-copy (earlier runs are copied).");

static PyObject *copy_runs(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *src_object, *dst_object, *columns[3];
    int nontemporal;
    if (!PyArg_ParseTuple(args, "OOOOOp:copy_runs", &src_object, &dst_object, &columns[0], &columns[1],
                          &columns[2], &nontemporal))
        return NULL;
    uint64_t src_base, dst_base;
    if (get_address(src_object, &src_base, "src_base") < 0 || get_address(dst_object, &dst_base, "dst_base") < 0)
        return NULL;
    static const char *names[3] = {"src_offsets", "dst_offsets", "lengths"};
    Py_buffer views[3];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 3; got++)
        if (get_column(columns[got], &views[got], names[got]) < 0)
            goto done;
    Py_ssize_t count = views[0].shape[0];
    if (views[1].shape[0] != count || views[2].shape[0] != count) {
        PyErr_SetString(PyExc_ValueError, "src_offsets, dst_offsets and lengths must have equal lengths");
        goto done;
    }
    const uint64_t *src_offsets = views[0].buf, *dst_offsets = views[1].buf, *lengths = views[2].buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (src_offsets[i] > UINT64_MAX - src_base || lengths[i] > UINT64_MAX - (src_base + src_offsets[i]) ||
            dst_offsets[i] > UINT64_MAX - dst_base || lengths[i] > UINT64_MAX - (dst_base + dst_offsets[i])) {
            PyErr_Format(PyExc_ValueError, "run %zd passes the end of the address space", i);
            goto done;
        }
    }
    volatile Py_ssize_t faulted = -1;
    Py_BEGIN_ALLOW_THREADS
    sigjmp_buf jump;
    guard_enter();
    if (sigsetjmp(jump, 1) == 0) {
        guard_jump = &jump;
        for (Py_ssize_t i = 0; i < count; i++) {
            faulted = i;
            char *dst = (char *)(uintptr_t)(dst_base + dst_offsets[i]);
            const char *src = (const char *)(uintptr_t)(src_base + src_offsets[i]);
            size_t nbytes = (size_t)lengths[i];
            if (dst < src + nbytes && src < dst + nbytes)
                memmove(dst, src, nbytes);
#if HAVE_STREAMING
            else if (nontemporal)
                copy_streaming(dst, src, nbytes);
#endif
            else
                memcpy(dst, src, nbytes);
        }
        faulted = -1;
    }
    guard_jump = NULL;
    guard_leave();
#if HAVE_STREAMING
    if (nontemporal)
        _mm_sfence(); /* streaming stores are weakly ordered: make them visible before we return */
#endif
    Py_END_ALLOW_THREADS
    if (faulted >= 0) {
        errno = EFAULT;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    while (got-- > 0)
        PyBuffer_Release(&views[got]);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_runs", copy_runs, METH_VARARGS, copy_runs_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_copykernel",
    .m_doc = "Copies lists of byte runs with the GIL released.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__copykernel(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", HAVE_STREAMING) < 0)
        Py_CLEAR(m);
    return m;
}
