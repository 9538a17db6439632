/* The request path's trace recorder, compiled: what atomesh/tracing.py's PyRecorder and PyTrace do, each
   record written straight into the batch's `marshal` stream.

   atomesh/tracing.py builds this on first use (a CPython extension module, cached per source and Python,
   as atomesh/splice.c is) and records with it where it builds; else with PyRecorder, which makes the same
   records (tests/test_tracing.py compares them). A record is the one atomesh/otlp.py describes. Here a Trace
   keeps it as the bytes `marshal.dumps(..., 4)` writes for its items (without back-references, which
   marshal.loads and atomesh/otlp_encode.c read or do without alike): the request path makes no Python object
   per item, and no `marshal` pass over them is made when the batch leaves; `Recorder.frame` is the batch's
   bytes behind a head. Ids come from a pool of random bytes the kernel fills (getrandom), 4 KB at a time,
   emptied in a child after fork. Single-threaded like the event loop that calls it: no lock. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

enum { ADMISSION, ATTEMPT, PREFILL, DECODE, UPSTREAM, NKINDS }; /* atomesh.otlp's kinds of child span */
enum { RANDOM_BYTES = 4096 };

/* Forks seen: a child's pool starts empty, so that it draws ids of its own (the module's only state besides
   HEX_PAIRS, a table written once at import). */
static unsigned long forks;
static void after_fork_in_child(void) { forks++; }

static const char HEX[] = "0123456789abcdef";

/* ------------------------------------------------------------------ marshal's format, as written here */

typedef struct {
    char *p;
    Py_ssize_t n, cap;
} Buf;

static int grow(Buf *b, Py_ssize_t more) {
    Py_ssize_t cap = b->cap ? b->cap : 512;
    while (cap < b->n + more)
        cap *= 2;
    char *p = PyMem_Realloc(b->p, (size_t)cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

static inline int reserve(Buf *b, Py_ssize_t more) { return b->n + more <= b->cap ? 0 : grow(b, more); }

static void put_i32(char *at, int32_t v) { memcpy(at, &v, 4); } /* marshal's ints: little-endian */

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "marshal's ints and floats are written as the host's bytes: a little-endian host only"
#endif

static inline int w_float(Buf *b, double t) {
    if (reserve(b, 9) < 0)
        return -1;
    b->p[b->n] = 'g'; /* TYPE_BINARY_FLOAT */
    memcpy(b->p + b->n + 1, &t, 8);
    b->n += 9;
    return 0;
}

/* An int: 'i' (32 bits) when it fits, else 'l' (its 15-bit digits, least significant first). */
static inline int w_long(Buf *b, long long v) {
    if (v >= INT32_MIN && v <= INT32_MAX) {
        if (reserve(b, 5) < 0)
            return -1;
        b->p[b->n] = 'i';
        put_i32(b->p + b->n + 1, (int32_t)v);
        b->n += 5;
        return 0;
    }
    unsigned long long x = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    int32_t digits = 0;
    for (unsigned long long y = x; y; y >>= 15)
        digits++;
    if (reserve(b, 5 + 2 * digits) < 0)
        return -1;
    b->p[b->n] = 'l';
    put_i32(b->p + b->n + 1, v < 0 ? -digits : digits);
    b->n += 5;
    for (int32_t k = 0; k < digits; k++, x >>= 15) {
        uint16_t d = (uint16_t)(x & 0x7FFF);
        memcpy(b->p + b->n, &d, 2);
        b->n += 2;
    }
    return 0;
}

static int w_int(Buf *b, PyObject *v, const char *what) {
    if (!PyLong_CheckExact(v)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.80s", what, Py_TYPE(v)->tp_name);
        return -1;
    }
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    return w_long(b, x);
}

static inline int w_bytes(Buf *b, char code, const char *s, Py_ssize_t n) {
    if (n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "a string of a trace is too long");
        return -1;
    }
    int small = code == 'z';
    if (reserve(b, (small ? 2 : 5) + n) < 0)
        return -1;
    b->p[b->n] = code;
    if (small) {
        b->p[b->n + 1] = (char)n;
        b->n += 2;
    } else {
        put_i32(b->p + b->n + 1, (int32_t)n);
        b->n += 5;
    }
    memcpy(b->p + b->n, s, (size_t)n);
    b->n += n;
    return 0;
}

/* A str as marshal writes it: ASCII as 'z' (short) or 'a', else 'u' and its UTF-8 (surrogates passed). */
static inline int w_str(Buf *b, PyObject *v, const char *what) {
    if (!PyUnicode_CheckExact(v)) {
        PyErr_Format(PyExc_TypeError, "%s must be a str, not %.80s", what, Py_TYPE(v)->tp_name);
        return -1;
    }
    if (PyUnicode_IS_ASCII(v)) {
        Py_ssize_t n = PyUnicode_GET_LENGTH(v);
        return w_bytes(b, n < 256 ? 'z' : 'a', (const char *)PyUnicode_DATA(v), n);
    }
    PyObject *utf8 = PyUnicode_AsEncodedString(v, "utf8", "surrogatepass");
    if (utf8 == NULL)
        return -1;
    int r = w_bytes(b, 'u', PyBytes_AS_STRING(utf8), PyBytes_GET_SIZE(utf8));
    Py_DECREF(utf8);
    return r;
}

static int w_none(Buf *b) {
    if (reserve(b, 1) < 0)
        return -1;
    b->p[b->n++] = 'N';
    return 0;
}

static int w_str_or_none(Buf *b, PyObject *v, const char *what) { return v == Py_None ? w_none(b) : w_str(b, v, what); }

/* A tuple of strs: ')' and a count byte (short), else '(' and a 32-bit count. */
static int w_strs(Buf *b, PyObject *v, const char *what) {
    if (!PyTuple_CheckExact(v)) {
        PyErr_Format(PyExc_TypeError, "%s must be a tuple of str, not %.80s", what, Py_TYPE(v)->tp_name);
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(v);
    if (reserve(b, 5) < 0)
        return -1;
    if (n < 256) {
        b->p[b->n] = ')';
        b->p[b->n + 1] = (char)n;
        b->n += 2;
    } else {
        b->p[b->n] = '(';
        put_i32(b->p + b->n + 1, (int32_t)n);
        b->n += 5;
    }
    for (Py_ssize_t k = 0; k < n; k++)
        if (w_str(b, PyTuple_GET_ITEM(v, k), what) < 0)
            return -1;
    return 0;
}

/* time.monotonic(), as CPython makes it from the clock's nanoseconds. */
static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t ns = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    return ns % 1000000000 == 0 ? (double)(ns / 1000000000) : (double)ns / 1e9;
}

/* ------------------------------------------------------------------ Recorder: the batch and the ids */

typedef struct {
    PyObject_HEAD
    PyObject *classes;             /* the priority classes' names, by value */
    Buf batch;                     /* the batch's records, as marshal writes their items */
    Py_ssize_t items;              /* items in the batch */
    long spans;                    /* spans in the batch */
    uint8_t random[RANDOM_BYTES];  /* from getrandom; random[used:] not yet taken */
    Py_ssize_t used;
    unsigned long forks;           /* `forks` when the pool was filled */
} Recorder;

/* `n` random bytes from the pool (refilled when short), not all zero: W3C's ids may not be. */
static int take_random(Recorder *rec, uint8_t *out, Py_ssize_t n) {
    for (;;) {
        if (rec->forks != forks || RANDOM_BYTES - rec->used < n) {
            Py_ssize_t got = 0;
            while (got < RANDOM_BYTES) {
                ssize_t k = getrandom(rec->random + got, (size_t)(RANDOM_BYTES - got), 0);
                if (k < 0) {
                    if (errno == EINTR)
                        continue;
                    PyErr_SetFromErrno(PyExc_OSError);
                    return -1;
                }
                got += k;
            }
            rec->used = 0;
            rec->forks = forks;
        }
        const uint8_t *p = rec->random + rec->used;
        rec->used += n;
        uint8_t any = 0;
        for (Py_ssize_t k = 0; k < n; k++)
            any |= p[k];
        if (any) {
            memcpy(out, p, (size_t)n);
            return 0;
        }
    }
}

/* Each byte's two hex digits. */
static char HEX_PAIRS[256][2];

static void hex(char *out, const uint8_t *s, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++)
        memcpy(out + 2 * k, HEX_PAIRS[s[k]], 2);
}

static int is_hex(PyObject *v, Py_ssize_t n) {
    if (!PyUnicode_CheckExact(v) || !PyUnicode_IS_ASCII(v) || PyUnicode_GET_LENGTH(v) != n)
        return 0;
    const char *s = (const char *)PyUnicode_DATA(v);
    for (Py_ssize_t k = 0; k < n; k++)
        if (!((s[k] >= '0' && s[k] <= '9') || (s[k] >= 'a' && s[k] <= 'f')))
            return 0;
    return 1;
}

/* ------------------------------------------------------------------ Trace: one sampled request's record */

typedef struct {
    PyObject_HEAD
    Recorder *recorder;  /* its batch, classes and pool (a reference) */
    char prefix[50];     /* "00-<trace id>-<the request span id's first 7 bytes>" */
    uint64_t base;       /* the request span's id: those 7 bytes, then a zero byte */
    Buf record;          /* its items so far, as marshal writes them */
    Py_ssize_t items;
    long spans;          /* the request span and the children begun */
    Py_ssize_t *open;    /* the open children's begins (item indices), innermost last */
    Py_ssize_t depth, open_cap;
    int failed;
    long status;         /* the refusal's HTTP status, when failed */
    PyObject *error;     /* the gateway's error code, when failed */
} Trace;

static PyTypeObject TraceType;

static void Trace_dealloc(Trace *t) {
    Py_XDECREF(t->recorder);
    Py_XDECREF(t->error);
    PyMem_Free(t->record.p);
    PyMem_Free(t->open);
    PyObject_Free(t);
}

/* A begin: its kind and time (its values follow), the span now the innermost open one. On an error the record
   is left as it was (`unbegin` takes back a begin whose values could not be written). */
static int begin(Trace *t, int kind, Py_ssize_t values) {
    if (t->depth == t->open_cap) {
        Py_ssize_t cap = t->open_cap ? 2 * t->open_cap : 4;
        Py_ssize_t *p = PyMem_Realloc(t->open, sizeof(Py_ssize_t) * (size_t)cap);
        if (p == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        t->open = p;
        t->open_cap = cap;
    }
    Py_ssize_t mark = t->record.n;
    if (w_long(&t->record, kind) < 0 || w_float(&t->record, now()) < 0) {
        t->record.n = mark;
        return -1;
    }
    t->open[t->depth++] = t->items;
    t->items += 2 + values;
    t->spans++;
    return 0;
}

static PyObject *unbegin(Trace *t, Py_ssize_t mark, Py_ssize_t values) {
    t->record.n = mark;
    t->depth--;
    t->items -= 2 + values;
    t->spans--;
    return NULL;
}

static PyObject *Trace_admission(Trace *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "admission(model, cls, tenant)");
        return NULL;
    }
    long cls = PyLong_AsLong(args[1]);
    if (cls == -1 && PyErr_Occurred())
        return NULL;
    if (cls < 0 || cls >= PyTuple_GET_SIZE(t->recorder->classes)) {
        PyErr_Format(PyExc_ValueError, "no priority class %ld", cls);
        return NULL;
    }
    Py_ssize_t mark = t->record.n;
    if (begin(t, ADMISSION, 3) < 0)
        return NULL;
    if (w_str(&t->record, PyTuple_GET_ITEM(t->recorder->classes, cls), "class") < 0 ||
        w_str(&t->record, args[2], "tenant") < 0 || w_str_or_none(&t->record, args[0], "model") < 0)
        return unbegin(t, mark, 3);
    Py_RETURN_NONE;
}

static PyObject *Trace_attempt(Trace *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "attempt(number, kind, policies, workers)");
        return NULL;
    }
    Py_ssize_t mark = t->record.n;
    if (begin(t, ATTEMPT, 4) < 0)
        return NULL;
    if (w_int(&t->record, args[0], "number") < 0 || w_str(&t->record, args[1], "kind") < 0 ||
        w_strs(&t->record, args[2], "policies") < 0 || w_strs(&t->record, args[3], "workers") < 0)
        return unbegin(t, mark, 4);
    Py_RETURN_NONE;
}

static PyObject *Trace_leg(Trace *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "leg(leg, url)");
        return NULL;
    }
    long leg = PyLong_AsLong(args[0]);
    if (leg == -1 && PyErr_Occurred())
        return NULL;
    if (leg != PREFILL && leg != DECODE && leg != UPSTREAM) {
        PyErr_Format(PyExc_ValueError, "%ld is not a leg (PREFILL, DECODE or UPSTREAM)", leg);
        return NULL;
    }
    Py_ssize_t mark = t->record.n;
    if (begin(t, (int)leg, 1) < 0)
        return NULL;
    if (w_str(&t->record, args[1], "url") < 0)
        return unbegin(t, mark, 1);
    Py_RETURN_NONE;
}

static PyObject *Trace_end(Trace *t, PyObject *unused) {
    if (w_float(&t->record, now()) < 0)
        return NULL;
    if (t->depth)
        t->depth--;
    t->items++;
    Py_RETURN_NONE;
}

static PyObject *Trace_failed(Trace *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "failed(status, code)");
        return NULL;
    }
    long status = PyLong_AsLong(args[0]);
    if (status == -1 && PyErr_Occurred())
        return NULL;
    if (!PyUnicode_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "code must be a str");
        return NULL;
    }
    t->failed = 1;
    t->status = status;
    Py_INCREF(args[1]);
    Py_XSETREF(t->error, args[1]);
    Py_RETURN_NONE;
}

/* The sampled traceparent naming the innermost open span: its id is the request span's plus the index of its
   begin in the record (0 for the request span itself). */
static PyObject *Trace_traceparent(Trace *t, PyObject *unused) {
    uint64_t id = t->base + (uint64_t)(t->depth ? t->open[t->depth - 1] : 0);
    PyObject *s = PyUnicode_New(55, 127);
    if (s == NULL)
        return NULL;
    char *p = (char *)PyUnicode_DATA(s);
    memcpy(p, t->prefix, 36);
    uint64_t be = __builtin_bswap64(id);
    hex(p + 36, (const uint8_t *)&be, 8);
    memcpy(p + 52, "-01", 3);
    return s;
}

static PyObject *Trace_get_spans(Trace *t, void *unused) { return PyLong_FromLong(t->spans); }

static PyMethodDef Trace_methods[] = {
    {"admission", (PyCFunction)(void (*)(void))Trace_admission, METH_FASTCALL, "waiting for admission begins"},
    {"attempt", (PyCFunction)(void (*)(void))Trace_attempt, METH_FASTCALL, "one placement and its run begins"},
    {"leg", (PyCFunction)(void (*)(void))Trace_leg, METH_FASTCALL, "a call to one worker begins"},
    {"end", (PyCFunction)Trace_end, METH_NOARGS, "end the innermost open span"},
    {"failed", (PyCFunction)(void (*)(void))Trace_failed, METH_FASTCALL, "the request ends with the gateway's error"},
    {"traceparent", (PyCFunction)Trace_traceparent, METH_NOARGS, "the innermost open span's traceparent"},
    {NULL},
};

static PyGetSetDef Trace_getset[] = {
    {"spans", (getter)Trace_get_spans, NULL, "the request span and the children begun", NULL},
    {NULL},
};

static PyTypeObject TraceType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_atomesh_trace.Trace",
    .tp_basicsize = sizeof(Trace),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "the spans of one sampled request, as it runs (made by Recorder.trace)",
    .tp_dealloc = (destructor)Trace_dealloc,
    .tp_methods = Trace_methods,
    .tp_getset = Trace_getset,
};

/* ------------------------------------------------------------------ Recorder's methods */

static PyObject *Recorder_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    PyObject *classes;
    if (!PyArg_ParseTuple(args, "O!:Recorder", &PyTuple_Type, &classes))
        return NULL;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(classes); k++)
        if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(classes, k))) {
            PyErr_SetString(PyExc_TypeError, "classes must be a tuple of str");
            return NULL;
        }
    Recorder *rec = (Recorder *)type->tp_alloc(type, 0);
    if (rec == NULL)
        return NULL;
    Py_INCREF(classes);
    rec->classes = classes;
    rec->used = RANDOM_BYTES; /* empty: filled on first use */
    rec->forks = forks;
    return (PyObject *)rec;
}

static void Recorder_dealloc(Recorder *rec) {
    Py_XDECREF(rec->classes);
    PyMem_Free(rec->batch.p);
    Py_TYPE(rec)->tp_free((PyObject *)rec);
}

/* trace(trace_id, parent): a new request's Trace, its span started now. trace_id: the client's (32 hex
   digits), or None for a new trace; parent: the client's span (16 hex digits), or "". */
static PyObject *Recorder_trace(Recorder *rec, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "trace(trace_id, parent)");
        return NULL;
    }
    PyObject *trace_id = args[0], *parent = args[1];
    if (trace_id != Py_None && !is_hex(trace_id, 32)) {
        PyErr_SetString(PyExc_ValueError, "trace_id must be 32 lower-case hex digits, or None");
        return NULL;
    }
    if (!is_hex(parent, 0) && !is_hex(parent, 16)) {
        PyErr_SetString(PyExc_ValueError, "parent must be 16 lower-case hex digits, or \"\"");
        return NULL;
    }
    uint8_t ids[23];
    if ((trace_id == Py_None && take_random(rec, ids, 16) < 0) || take_random(rec, ids + 16, 7) < 0)
        return NULL;
    Trace *t = PyObject_New(Trace, &TraceType);
    if (t == NULL)
        return NULL;
    Py_INCREF(rec);
    t->recorder = rec;
    t->record = (Buf){NULL, 0, 0};
    t->items = 3;
    t->spans = 1;
    t->open = NULL;
    t->depth = t->open_cap = 0;
    t->failed = 0;
    t->status = 0;
    t->error = NULL;
    memcpy(t->prefix, "00-", 3);
    if (trace_id == Py_None)
        hex(t->prefix + 3, ids, 16);
    else
        memcpy(t->prefix + 3, PyUnicode_DATA(trace_id), 32);
    t->prefix[35] = '-';
    hex(t->prefix + 36, ids + 16, 7);
    t->base = 0;
    for (int k = 16; k < 23; k++)
        t->base = t->base << 8 | ids[k];
    t->base <<= 8;
    if (w_bytes(&t->record, 'z', t->prefix, 50) < 0 || w_str(&t->record, parent, "parent") < 0 ||
        w_float(&t->record, now()) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

/* unsampled(): a traceparent of random ids flagged not sampled. */
static PyObject *Recorder_unsampled(Recorder *rec, PyObject *unused) {
    uint8_t ids[24];
    if (take_random(rec, ids, 16) < 0 || take_random(rec, ids + 16, 8) < 0)
        return NULL;
    PyObject *s = PyUnicode_New(55, 127);
    if (s == NULL)
        return NULL;
    char *p = (char *)PyUnicode_DATA(s);
    memcpy(p, "00-", 3);
    hex(p + 3, ids, 16);
    p[35] = '-';
    hex(p + 36, ids + 16, 8);
    memcpy(p + 52, "-00", 3);
    return s;
}

/* add(trace, route, request_id, status): the request ends; its record (with its route, request id, status,
   error and end) joins the batch. status: the answer's (the trace's refusal status if it failed). Returns
   the batch's spans. */
static PyObject *Recorder_add(Recorder *rec, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || Py_TYPE(args[0]) != &TraceType) {
        PyErr_SetString(PyExc_TypeError, "add(trace, route, request_id, status), trace a Trace");
        return NULL;
    }
    Trace *t = (Trace *)args[0];
    Buf *b = &rec->batch;
    Py_ssize_t mark = b->n;
    if (reserve(b, t->record.n) < 0)
        return NULL;
    memcpy(b->p + b->n, t->record.p, (size_t)t->record.n);
    b->n += t->record.n;
    if (w_str(b, args[1], "route") < 0 || w_str(b, args[2], "request_id") < 0)
        goto fail;
    if (t->failed ? w_long(b, t->status) < 0 : w_int(b, args[3], "status") < 0)
        goto fail;
    if ((t->failed ? w_str(b, t->error, "error") : w_none(b)) < 0 || w_float(b, now()) < 0)
        goto fail;
    rec->items += t->items + 5;
    rec->spans += t->spans;
    return PyLong_FromLong(rec->spans);
fail:
    b->n = mark;
    return NULL;
}

/* frame(anchor_ns, anchor): the batch as the sender reads it, a 4-byte big-endian length then
   marshal's (anchor_ns, anchor, [items...]); the batch is emptied. */
static PyObject *Recorder_frame(Recorder *rec, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "frame(anchor_ns, anchor)");
        return NULL;
    }
    long long anchor_ns = PyLong_AsLongLong(args[0]);
    if (anchor_ns == -1 && PyErr_Occurred())
        return NULL;
    double anchor = PyFloat_AsDouble(args[1]);
    if (anchor == -1.0 && PyErr_Occurred())
        return NULL;
    if (rec->items > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "a batch of more than 2**31 items");
        return NULL;
    }
    Buf head = {NULL, 0, 0};
    if (reserve(&head, 64) < 0)
        return NULL;
    head.n = 4; /* the length, below */
    head.p[head.n++] = ')'; /* a small tuple of 3 */
    head.p[head.n++] = 3;
    if (w_long(&head, anchor_ns) < 0 || w_float(&head, anchor) < 0) {
        PyMem_Free(head.p);
        return NULL;
    }
    head.p[head.n] = '[';
    put_i32(head.p + head.n + 1, (int32_t)rec->items);
    head.n += 5;
    Py_ssize_t size = head.n - 4 + rec->batch.n;
    if (size > UINT32_MAX) {
        PyMem_Free(head.p);
        PyErr_SetString(PyExc_OverflowError, "a frame of more than 4 GB");
        return NULL;
    }
    uint32_t be = __builtin_bswap32((uint32_t)size);
    memcpy(head.p, &be, 4);
    PyObject *frame = PyBytes_FromStringAndSize(NULL, head.n + rec->batch.n);
    if (frame != NULL) {
        memcpy(PyBytes_AS_STRING(frame), head.p, (size_t)head.n);
        if (rec->batch.n)
            memcpy(PyBytes_AS_STRING(frame) + head.n, rec->batch.p, (size_t)rec->batch.n);
        rec->batch.n = 0;
        rec->items = 0;
        rec->spans = 0;
    }
    PyMem_Free(head.p);
    return frame;
}

static PyObject *Recorder_get_spans(Recorder *rec, void *unused) { return PyLong_FromLong(rec->spans); }

static PyMethodDef Recorder_methods[] = {
    {"trace", (PyCFunction)(void (*)(void))Recorder_trace, METH_FASTCALL, "a new request's Trace"},
    {"unsampled", (PyCFunction)Recorder_unsampled, METH_NOARGS, "a traceparent of random ids, not sampled"},
    {"add", (PyCFunction)(void (*)(void))Recorder_add, METH_FASTCALL, "a request's record joins the batch"},
    {"frame", (PyCFunction)(void (*)(void))Recorder_frame, METH_FASTCALL, "the batch as a frame; emptied"},
    {NULL},
};

static PyGetSetDef Recorder_getset[] = {
    {"spans", (getter)Recorder_get_spans, NULL, "the spans in the batch", NULL},
    {NULL},
};

static PyTypeObject RecorderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_atomesh_trace.Recorder",
    .tp_basicsize = sizeof(Recorder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Recorder(classes): the traces of a gateway process and their batch",
    .tp_new = Recorder_new,
    .tp_dealloc = (destructor)Recorder_dealloc,
    .tp_methods = Recorder_methods,
    .tp_getset = Recorder_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_atomesh_trace", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__atomesh_trace(void) {
    if (PyType_Ready(&TraceType) < 0 || PyType_Ready(&RecorderType) < 0)
        return NULL;
    for (int k = 0; k < 256; k++) {
        HEX_PAIRS[k][0] = HEX[k >> 4];
        HEX_PAIRS[k][1] = HEX[k & 15];
    }
    static int registered;
    if (!registered) {
        if (pthread_atfork(NULL, NULL, after_fork_in_child) != 0) {
            PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
            return NULL;
        }
        registered = 1;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Trace", (PyObject *)&TraceType) < 0 ||
        PyModule_AddObjectRef(m, "Recorder", (PyObject *)&RecorderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
