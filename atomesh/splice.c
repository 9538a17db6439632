/* A streamed response relayed from a worker's socket to a client's without the interpreter per event.

   atomesh/splice.py compiles this on first use (a CPython extension module, cached per source and
   Python) and atomesh/httpclient.py (`Response.splice`) drives it. A `Splice` owns two duplicated
   descriptors: the worker connection (its asyncio transport paused meanwhile) and the client's. For each
   read of the worker's socket it decodes the chunked body, does the token meter's per-event work by the
   rules of `RequestMeter.feed` (atomesh/metrics.py; handed back with `counts()`), frames each piece as its
   own chunk for the client (as `FrontExchange.push` does) and sends them with one send. `state` says why
   it stopped; the caller then finishes in Python as the parsed relay would.

   Two ways to run one. Normally the `Relayer`, the process's relay thread, runs it: its own epoll, no
   GIL (so nothing here that it runs calls Python or allocates with Python's object allocator); a splice
   it stops is queued and the event loop hears of it through an eventfd (`collect()`, which calls the
   splice's `stop` callback). Otherwise the event loop calls `step()` when the worker's socket is
   readable, and `stop` is called at once. A client that stops taking bytes (a short send) pauses a splice
   the thread runs (its unsent bytes kept in `pending`); the loop then drives it in `spill` mode: each
   read's framed output goes to the Python `spill` callback (the client's transport buffers it), which
   returns False when the client is to be waited for (state PAUSED). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define READ_SIZE 65536
#define MARKER "data: {"
#define MARKER_LEN 7
#define TAIL_MAX (MARKER_LEN - 1)
#define KEEP (64 * 1024) /* metrics._KEEP */

enum { RUNNING, DONE, EOF_, READ_ERROR, PROTOCOL_ERROR, CLIENT_ERROR, PAUSED, CALLBACK_ERROR };

enum { S_SIZE0, S_SIZE, S_EXT, S_SIZE_LF, S_DATA, S_DATA_CR, S_DATA_LF, S_TRAILER0, S_TRAILER, S_TRAILER_LF, S_END_LF, S_DONE };

typedef struct Splice {
    PyObject_HEAD
    int wfd, cfd;
    int state, err, chunk_state, spilled, extra;
    const char *why;        /* a protocol error's reason */
    unsigned long long size; /* the chunk being read: its size, then what is left of it */
    int size_digits;
    PyObject *stop;         /* called once when the splice stops */
    PyObject *spill;        /* takes the framed output once the client is slow */
    PyObject *error;        /* what a callback raised */
    int counting;           /* metering the stream (a meter was given) */
    int seen_first;         /* the first event with content (TTFT) */
    long long events;       /* content-bearing events from the first token on */
    double first_at, last_at;
    long long sent;         /* body bytes given to the client */
    char tail[TAIL_MAX];
    int tail_len;
    char *end; Py_ssize_t end_len, end_cap;  /* the stream from its last event on, as the meter keeps it */
    char *out; Py_ssize_t out_len, out_cap;  /* framed output not sent yet */
    char *scratch; Py_ssize_t scratch_cap;   /* a piece joined to the tail, until the first token */
    struct Relayer *owner;  /* the relay thread running this splice, or NULL: driven by the event loop */
    int retired;            /* taken back from the relay thread (cancelled): it no longer touches it */
    struct Splice *next;    /* in the relay thread's list of splices to report */
} Splice;

/* The relay thread: one per gateway process, its own epoll, relaying every spliced stream handed to it
   without the interpreter (it never takes the GIL). A splice it stops (end, failure, a slow client) is
   queued and reported to the event loop through an eventfd; `collect()` then wakes each one's coroutine. */
typedef struct Relayer {
    PyObject_HEAD
    int ep, wake, notify;
    int started, stopping;
    pthread_t thread;
    pthread_mutex_t mu;
    Splice *done;           /* stopped or retired splices, to report (each holds a reference) */
    Splice *retire;         /* retired by the loop: moved to `done` by the thread after its current batch */
} Relayer;

/* The error being raised, as an exception object (Python 3.11 has no PyErr_GetRaisedException). */
static PyObject *fetch_error(void) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb && value) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

static PyTypeObject SpliceType;

/* Grows a buffer (the raw allocator: this may run on the relay thread, without the GIL). */
static int grow(char **p, Py_ssize_t *cap, Py_ssize_t need) {
    if (need <= *cap) return 0;
    Py_ssize_t cap2 = *cap ? *cap : 4096;
    while (cap2 < need) cap2 *= 2;
    char *q = PyMem_RawRealloc(*p, cap2);
    if (!q) return -1;
    *p = q; *cap = cap2;
    return 0;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.perf_counter's clock on Linux */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Occurrences of MARKER in p[0:n]: each '{' (memchr: a few an event) checked for the "data: " before it. */
static Py_ssize_t count_marker(const char *p, Py_ssize_t n) {
    Py_ssize_t c = 0;
    const char *q = p + MARKER_LEN - 1, *e = p + n;
    while (q < e) {
        const char *f = memchr(q, '{', (size_t)(e - q));
        if (!f) break;
        if (memcmp(f - (MARKER_LEN - 1), MARKER, MARKER_LEN - 1) == 0) c++;
        q = f + 1;
    }
    return c;
}

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

/* Where metrics._CONTENT first matches in p[0:n] (`"content"` or `"text"`, a colon, then a string that is
   not empty), else -1. */
static Py_ssize_t find_content(const char *p, Py_ssize_t n) {
    for (const char *q = memchr(p, '"', (size_t)n); q; q = memchr(q + 1, '"', (size_t)(p + n - q - 1))) {
        Py_ssize_t at = q - p, j;
        if (n - at >= 9 && memcmp(q, "\"content\"", 9) == 0) j = at + 9;
        else if (n - at >= 6 && memcmp(q, "\"text\"", 6) == 0) j = at + 6;
        else continue;
        while (j < n && is_space(p[j])) j++;
        if (j >= n || p[j] != ':') continue;
        j++;
        while (j < n && is_space(p[j])) j++;
        if (j >= n || p[j] != '"') continue;
        if (j + 1 < n && p[j + 1] == '"') continue;
        return at;
    }
    return -1;
}

/* The last MARKER wholly inside p[0:end], else -1 (bytes.rfind(MARKER, 0, end)). */
static Py_ssize_t rfind_marker(const char *p, Py_ssize_t end) {
    for (Py_ssize_t i = end - MARKER_LEN; i >= 0; i--)
        if (p[i] == 'd' && memcmp(p + i, MARKER, MARKER_LEN) == 0) return i;
    return -1;
}

/* The meter's bookkeeping for one piece: RequestMeter.feed, _join and _first (atomesh/metrics.py). */
static int meter(Splice *s, const char *p, Py_ssize_t n) {
    Py_ssize_t joined = s->tail_len + n;
    if (!s->seen_first) {
        /* The joined chunk, whole: the first event with content, and the events from the one holding it. */
        if (grow(&s->scratch, &s->scratch_cap, joined) < 0) return -1;
        memcpy(s->scratch, s->tail, s->tail_len);
        memcpy(s->scratch + s->tail_len, p, n);
        Py_ssize_t found = find_content(s->scratch, joined);
        if (found < 0) return 0;
        Py_ssize_t from = rfind_marker(s->scratch, found);
        s->seen_first = 1;
        s->first_at = s->last_at = now();
        s->events = count_marker(s->scratch + (from < 0 ? 0 : from), joined - (from < 0 ? 0 : from));
        if (grow(&s->end, &s->end_cap, joined) < 0) return -1;
        memcpy(s->end, s->scratch, joined);
        s->end_len = joined;
        return 0;
    }
    Py_ssize_t found = 0;
    if (s->tail_len) {
        char edge[2 * TAIL_MAX];
        Py_ssize_t head = n < TAIL_MAX ? n : TAIL_MAX;
        memcpy(edge, s->tail, s->tail_len);
        memcpy(edge + s->tail_len, p, head);
        for (Py_ssize_t i = 0; i < s->tail_len && i + MARKER_LEN <= s->tail_len + head; i++)
            if (memcmp(edge + i, MARKER, MARKER_LEN) == 0) found++;
    }
    found += count_marker(p, n);
    if (found) {
        s->events += found;
        s->last_at = now();
        s->end_len = 0;
    }
    if (found || s->end_len < KEEP) {
        if (grow(&s->end, &s->end_cap, s->end_len + joined) < 0) return -1;
        memcpy(s->end + s->end_len, s->tail, s->tail_len);
        memcpy(s->end + s->end_len + s->tail_len, p, n);
        s->end_len += joined;
    }
    return 0;
}

/* The tail the meter keeps after a piece: the joined piece's last bytes, unless it ends a line. */
static void keep_tail(Splice *s, const char *p, Py_ssize_t n) {
    if (n && p[n - 1] == '\n') { s->tail_len = 0; return; }
    char joined[2 * TAIL_MAX];
    Py_ssize_t take = n < TAIL_MAX ? n : TAIL_MAX;
    Py_ssize_t have = s->tail_len;
    memcpy(joined, s->tail, have);
    memcpy(joined + have, p + n - take, take);
    Py_ssize_t total = have + take;
    Py_ssize_t keep = total < TAIL_MAX ? total : TAIL_MAX;
    memmove(s->tail, joined + total - keep, keep);
    s->tail_len = (int)keep;
}

static int piece(Splice *s, const char *p, Py_ssize_t n) {
    if (n <= 0) return 0;
    if (s->counting && meter(s, p, n) < 0) return -1;
    keep_tail(s, p, n);
    s->sent += n;
    char line[24]; /* the chunk's size line, in hex (snprintf costs ~1k instructions a call) */
    int ln = 0;
    for (int shift = 60; shift >= 0; shift -= 4) {
        unsigned d = (unsigned)(((size_t)n >> shift) & 15);
        if (d || ln || shift == 0) line[ln++] = "0123456789abcdef"[d];
    }
    line[ln++] = '\r';
    line[ln++] = '\n';
    if (grow(&s->out, &s->out_cap, s->out_len + ln + n + 2) < 0) return -1;
    memcpy(s->out + s->out_len, line, ln);
    memcpy(s->out + s->out_len + ln, p, n);
    memcpy(s->out + s->out_len + ln + n, "\r\n", 2);
    s->out_len += ln + n + 2;
    return 0;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Decode `n` bytes of the chunked body; 0, or -1 with a Python error set (a callback's), or -2: invalid. */
static int decode(Splice *s, const char *p, Py_ssize_t n) {
    Py_ssize_t i = 0;
    while (i < n) {
        char c = p[i];
        switch (s->chunk_state) {
        case S_SIZE0:
        case S_SIZE: {
            int v = hexval(c);
            if (v >= 0) {
                if (++s->size_digits > 15) { s->why = "chunk size too large"; return -2; }
                s->size = s->size * 16 + (unsigned)v;
                s->chunk_state = S_SIZE;
            } else if (s->chunk_state == S_SIZE0) {
                s->why = "invalid character in chunk size"; return -2;
            } else if (c == '\r') {
                s->chunk_state = S_SIZE_LF;
            } else if (c == ';' || c == ' ' || c == '\t') {
                s->chunk_state = S_EXT;
            } else {
                s->why = "invalid character in chunk size"; return -2;
            }
            i++;
            break;
        }
        case S_EXT:
            if (c == '\r') s->chunk_state = S_SIZE_LF;
            else if (c == '\n') { s->why = "invalid chunk extension"; return -2; }
            i++;
            break;
        case S_SIZE_LF:
            if (c != '\n') { s->why = "expected LF after chunk size"; return -2; }
            i++;
            s->size_digits = 0;
            s->chunk_state = s->size ? S_DATA : S_TRAILER0;
            break;
        case S_DATA: {
            Py_ssize_t take = n - i;
            if ((unsigned long long)take > s->size) take = (Py_ssize_t)s->size;
            if (piece(s, p + i, take) < 0) return -1;
            s->size -= (unsigned long long)take;
            i += take;
            if (!s->size) s->chunk_state = S_DATA_CR;
            break;
        }
        case S_DATA_CR:
            if (c != '\r') { s->why = "expected CRLF after chunk data"; return -2; }
            s->chunk_state = S_DATA_LF; i++;
            break;
        case S_DATA_LF:
            if (c != '\n') { s->why = "expected CRLF after chunk data"; return -2; }
            s->chunk_state = S_SIZE0; i++;
            break;
        case S_TRAILER0:
            s->chunk_state = c == '\r' ? S_END_LF : S_TRAILER;
            i++;
            break;
        case S_TRAILER:
            if (c == '\r') s->chunk_state = S_TRAILER_LF;
            i++;
            break;
        case S_TRAILER_LF:
            if (c != '\n') { s->why = "expected LF after a trailer"; return -2; }
            s->chunk_state = S_TRAILER0; i++;
            break;
        case S_END_LF:
            if (c != '\n') { s->why = "expected LF after the last chunk"; return -2; }
            s->chunk_state = S_DONE; i++;
            break;
        case S_DONE:
            s->extra = 1; /* bytes after the response: the connection cannot be reused */
            return 0;
        }
    }
    return 0;
}

static void stop(Splice *s, int state) {
    if (s->state != RUNNING) return;
    s->state = state;
    if (s->owner) return; /* the relay thread reports it */
    PyObject *cb = s->stop;
    if (cb) {
        PyObject *r = PyObject_CallNoArgs(cb);
        if (r) Py_DECREF(r);
        else if (!s->error) s->error = fetch_error();
        else PyErr_Clear();
    }
}

/* Send the framed output: to the client's socket, or to `spill` once the client has been slow. */
static void flush(Splice *s) {
    if (!s->out_len) return;
    if (!s->spilled) {
        ssize_t w = send(s->cfd, s->out, (size_t)s->out_len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w == s->out_len) { s->out_len = 0; return; }
        if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            s->err = errno;
            stop(s, CLIENT_ERROR);
            return;
        }
        if (w > 0) {
            memmove(s->out, s->out + w, s->out_len - w);
            s->out_len -= w;
        }
        if (s->owner) { stop(s, PAUSED); return; } /* the loop spills `pending` and drives the rest */
        s->spilled = 1;
    }
    if (!s->spill) { stop(s, PAUSED); return; }
    PyObject *data = PyBytes_FromStringAndSize(s->out, s->out_len);
    if (!data) { s->error = fetch_error(); stop(s, CALLBACK_ERROR); return; }
    s->out_len = 0;
    PyObject *r = PyObject_CallOneArg(s->spill, data);
    Py_DECREF(data);
    if (!r) { s->error = fetch_error(); stop(s, CALLBACK_ERROR); return; }
    int more = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (!more) stop(s, PAUSED);
}

static void consume(Splice *s, const char *p, Py_ssize_t n) {
    int r = decode(s, p, n);
    if (r == -1) { /* out of memory: the loop raises MemoryError */
        stop(s, CALLBACK_ERROR);
        return;
    }
    flush(s);
    if (s->state != RUNNING) return;
    if (r == -2) stop(s, PROTOCOL_ERROR);
    else if (s->chunk_state == S_DONE) stop(s, DONE);
}

static PyObject *Splice_step(Splice *s, PyObject *Py_UNUSED(ignored)) {
    if (s->state != RUNNING) Py_RETURN_NONE; /* a readiness reported before the reader was removed */
    char buf[READ_SIZE]; /* on the stack: a buffer in the object would be zeroed for every stream */
    ssize_t n = read(s->wfd, buf, READ_SIZE);
    if (n > 0) consume(s, buf, n);
    else if (n == 0) stop(s, EOF_);
    else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) { s->err = errno; stop(s, READ_ERROR); }
    Py_RETURN_NONE;
}

static PyObject *Splice_feed(Splice *s, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    if (s->state == RUNNING) consume(s, view.buf, view.len);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *Splice_resume(Splice *s, PyObject *Py_UNUSED(ignored)) {
    if (s->state == PAUSED) s->state = RUNNING;
    Py_RETURN_NONE;
}

static PyObject *Splice_take_pending(Splice *s, PyObject *Py_UNUSED(ignored)) {
    PyObject *b = PyBytes_FromStringAndSize(s->out, s->out_len);
    if (b) s->out_len = 0;
    return b;
}

/* Taken back from the relay thread: the loop drives it from now on (a paused splice; the client was slow). */
static PyObject *Splice_to_loop(Splice *s, PyObject *Py_UNUSED(ignored)) {
    if (s->owner) { PyErr_SetString(PyExc_RuntimeError, "the relay thread still runs this splice"); return NULL; }
    s->spilled = 1;
    if (s->state == PAUSED) s->state = RUNNING;
    Py_RETURN_NONE;
}

static void wake_thread(Relayer *r) {
    uint64_t one = 1;
    ssize_t w = write(r->wake, &one, sizeof one);
    (void)w;
}

/* Taken back from the relay thread before its end (the request was cancelled or timed out): the thread
   stops reading its socket now and never touches it again; the loop's `collect()` drops it later. */
static PyObject *Splice_cancel(Splice *s, PyObject *Py_UNUSED(ignored)) {
    Relayer *r = s->owner;
    if (!r) Py_RETURN_NONE;
    pthread_mutex_lock(&r->mu);
    if (r->stopping && !s->retired && s->state == RUNNING) {
        /* The thread is gone (the pool closed) and this splice is on no list: released here. */
        s->retired = 1;
        epoll_ctl(r->ep, EPOLL_CTL_DEL, s->wfd, NULL);
        s->owner = NULL;
        pthread_mutex_unlock(&r->mu);
        Py_DECREF(s);
        Py_DECREF(r);
        Py_RETURN_NONE;
    }
    if (!s->retired) {
        s->retired = 1;
        if (s->state == RUNNING) {
            epoll_ctl(r->ep, EPOLL_CTL_DEL, s->wfd, NULL);
            s->next = r->retire; /* not queued yet: the thread queues it for collect() */
            r->retire = s;
        }
    }
    pthread_mutex_unlock(&r->mu);
    wake_thread(r);
    Py_RETURN_NONE;
}

static PyObject *Splice_take_error(Splice *s, PyObject *Py_UNUSED(ignored)) {
    PyObject *e = s->error;
    s->error = NULL;
    if (e) return e;
    if (s->state == CALLBACK_ERROR) return PyObject_CallNoArgs(PyExc_MemoryError);
    Py_RETURN_NONE;
}

static PyObject *Splice_counts(Splice *s, PyObject *Py_UNUSED(ignored)) {
    if (!s->counting) Py_RETURN_NONE;
    if (!s->seen_first)
        return Py_BuildValue("(OLdy#y#)", Py_None, 0LL, 0.0, "", (Py_ssize_t)0, s->tail, (Py_ssize_t)s->tail_len);
    return Py_BuildValue("(dLdy#y#)", s->first_at, s->events, s->last_at, s->end, s->end_len, s->tail,
                         (Py_ssize_t)s->tail_len);
}

static void close_fds(Splice *s) {
    if (s->wfd >= 0) { close(s->wfd); s->wfd = -1; }
    if (s->cfd >= 0) { close(s->cfd); s->cfd = -1; }
}

static PyObject *Splice_close(Splice *s, PyObject *Py_UNUSED(ignored)) {
    close_fds(s);
    Py_CLEAR(s->stop);
    Py_CLEAR(s->spill);
    Py_RETURN_NONE;
}

static int Splice_init(Splice *s, PyObject *args, PyObject *kw) {
    static char *names[] = {"worker_fd", "client_fd", "metered", "stop", "spill", NULL};
    int wfd, cfd, metered;
    PyObject *stopcb, *spill;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iipOO", names, &wfd, &cfd, &metered, &stopcb, &spill)) return -1;
    s->wfd = wfd;
    s->cfd = cfd;
    s->counting = metered;
    s->stop = Py_NewRef(stopcb);
    s->spill = spill == Py_None ? NULL : Py_NewRef(spill);
    return 0;
}

static PyObject *Splice_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Splice *s = (Splice *)type->tp_alloc(type, 0);
    if (s) { s->wfd = s->cfd = -1; s->state = RUNNING; s->chunk_state = S_SIZE0; }
    return (PyObject *)s;
}

static void Splice_dealloc(Splice *s) {
    close_fds(s);
    Py_CLEAR(s->stop);
    Py_CLEAR(s->spill);
    Py_CLEAR(s->error);
    PyMem_Free(s->end);
    PyMem_Free(s->out);
    PyMem_Free(s->scratch);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *get_state(Splice *s, void *c) {
    Relayer *r = s->owner;
    if (!r) return PyLong_FromLong(s->state);
    pthread_mutex_lock(&r->mu);
    int state = s->state;
    pthread_mutex_unlock(&r->mu);
    return PyLong_FromLong(state);
}
static PyObject *get_threaded(Splice *s, void *c) { return PyBool_FromLong(s->owner != NULL); }
static PyObject *get_err(Splice *s, void *c) { return PyLong_FromLong(s->err); }
static PyObject *get_sent(Splice *s, void *c) { return PyLong_FromLongLong(s->sent); }
static PyObject *get_extra(Splice *s, void *c) { return PyBool_FromLong(s->extra); }
static PyObject *get_why(Splice *s, void *c) { return PyUnicode_FromString(s->why ? s->why : ""); }
static PyObject *get_pending(Splice *s, void *c) { return PyBytes_FromStringAndSize(s->out, s->out_len); }

static PyGetSetDef Splice_getset[] = {
    {"state", (getter)get_state, NULL, "RUNNING, DONE, EOF, READ_ERROR, PROTOCOL_ERROR, CLIENT_ERROR, PAUSED or CALLBACK_ERROR", NULL},
    {"err", (getter)get_err, NULL, "errno of a failed read or send", NULL},
    {"sent", (getter)get_sent, NULL, "body bytes given to the client", NULL},
    {"extra", (getter)get_extra, NULL, "bytes followed the response", NULL},
    {"why", (getter)get_why, NULL, "why the body is invalid", NULL},
    {"pending", (getter)get_pending, NULL, "framed output not sent (the client was slow)", NULL},
    {"threaded", (getter)get_threaded, NULL, "run by the relay thread", NULL},
    {NULL},
};

static PyMethodDef Splice_methods[] = {
    {"step", (PyCFunction)Splice_step, METH_NOARGS, "read the worker's socket once and relay what came"},
    {"feed", (PyCFunction)Splice_feed, METH_O, "relay body bytes read before the splice began"},
    {"resume", (PyCFunction)Splice_resume, METH_NOARGS, "run again after PAUSED"},
    {"take_error", (PyCFunction)Splice_take_error, METH_NOARGS, "what a callback raised, once"},
    {"take_pending", (PyCFunction)Splice_take_pending, METH_NOARGS, "the framed output not sent, once"},
    {"to_loop", (PyCFunction)Splice_to_loop, METH_NOARGS, "run from the event loop from now on (after PAUSED)"},
    {"cancel", (PyCFunction)Splice_cancel, METH_NOARGS, "take it back from the relay thread"},
    {"counts", (PyCFunction)Splice_counts, METH_NOARGS, "(first_at, events, last_at, end, tail) when metered, else None"},
    {"close", (PyCFunction)Splice_close, METH_NOARGS, "close both descriptors"},
    {NULL},
};

static PyTypeObject SpliceType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_atomesh_splice.Splice",
    .tp_basicsize = sizeof(Splice),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "one streamed response relayed between two sockets",
    .tp_new = Splice_new,
    .tp_init = (initproc)Splice_init,
    .tp_dealloc = (destructor)Splice_dealloc,
    .tp_methods = Splice_methods,
    .tp_getset = Splice_getset,
};

/* ------------------------------------------------------------------ the relay thread */

static void *relay_main(void *arg) {
    Relayer *r = arg;
    struct epoll_event ev[64];
    char buf[READ_SIZE];
    for (;;) {
        int n = epoll_wait(r->ep, ev, 64, -1);
        if (n < 0 && errno != EINTR) break;
        int report = 0;
        pthread_mutex_lock(&r->mu);
        if (r->stopping) { pthread_mutex_unlock(&r->mu); break; }
        for (int i = 0; i < n; i++) {
            Splice *s = ev[i].data.ptr;
            if (!s) { /* the loop's wake-up: retired splices to queue, or stopping */
                uint64_t v;
                ssize_t got = read(r->wake, &v, sizeof v);
                (void)got;
                continue;
            }
            if (s->retired || s->state != RUNNING) continue;
            ssize_t m = read(s->wfd, buf, READ_SIZE);
            if (m > 0) consume(s, buf, m);
            else if (m == 0) stop(s, EOF_);
            else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) { s->err = errno; stop(s, READ_ERROR); }
            if (s->state != RUNNING) {
                epoll_ctl(r->ep, EPOLL_CTL_DEL, s->wfd, NULL);
                s->next = r->done;
                r->done = s;
                report = 1;
            }
        }
        while (r->retire) { /* after the batch: no event of this round still names them */
            Splice *s = r->retire;
            r->retire = s->next;
            s->next = r->done;
            r->done = s;
            report = 1;
        }
        pthread_mutex_unlock(&r->mu);
        if (report) {
            uint64_t one = 1;
            ssize_t w = write(r->notify, &one, sizeof one);
            (void)w;
        }
    }
    return NULL;
}

static PyObject *Relayer_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Relayer *r = (Relayer *)type->tp_alloc(type, 0);
    if (!r) return NULL;
    r->ep = r->wake = r->notify = -1;
    pthread_mutex_init(&r->mu, NULL);
    r->ep = epoll_create1(EPOLL_CLOEXEC);
    r->wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    r->notify = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (r->ep < 0 || r->wake < 0 || r->notify < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(r);
        return NULL;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(r->ep, EPOLL_CTL_ADD, r->wake, &ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(r);
        return NULL;
    }
    int e = pthread_create(&r->thread, NULL, relay_main, r);
    if (e != 0) {
        errno = e;
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(r);
        return NULL;
    }
    r->started = 1;
    return (PyObject *)r;
}

/* Hand a splice (not run yet) to the thread: it reads the worker's socket from now on. */
static PyObject *Relayer_add(Relayer *r, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &SpliceType)) { PyErr_SetString(PyExc_TypeError, "a Splice"); return NULL; }
    Splice *s = (Splice *)arg;
    if (s->owner || s->state != RUNNING || !r->started || r->stopping) {
        PyErr_SetString(PyExc_RuntimeError, "the splice cannot be handed to the relay thread");
        return NULL;
    }
    Py_INCREF(s); /* held until collect() reports it */
    pthread_mutex_lock(&r->mu);
    s->owner = r;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = s};
    int rc = epoll_ctl(r->ep, EPOLL_CTL_ADD, s->wfd, &ev);
    if (rc < 0) s->owner = NULL;
    pthread_mutex_unlock(&r->mu);
    if (rc < 0) { Py_DECREF(s); return PyErr_SetFromErrno(PyExc_OSError); }
    Py_INCREF(r); /* the splice names it (`owner`) until released */
    Py_RETURN_NONE;
}

/* The loop's reader of the thread's eventfd: each splice stopped or retired since is released from the
   thread and its `stop` callback called (a retired one's coroutine is gone: not called). */
static PyObject *Relayer_collect(Relayer *r, PyObject *Py_UNUSED(ignored)) {
    uint64_t v;
    ssize_t got = read(r->notify, &v, sizeof v);
    (void)got;
    pthread_mutex_lock(&r->mu);
    Splice *s = r->done;
    r->done = NULL;
    for (Splice *t = s; t; t = t->next) t->owner = NULL;
    pthread_mutex_unlock(&r->mu);
    while (s) {
        Splice *next = s->next;
        s->next = NULL;
        if (!s->retired && s->stop) {
            PyObject *res = PyObject_CallNoArgs(s->stop);
            if (res) Py_DECREF(res);
            else PyErr_WriteUnraisable(s->stop);
        }
        Py_DECREF(s);
        Py_DECREF(r);
        s = next;
    }
    Py_RETURN_NONE;
}

static void relayer_stop(Relayer *r) {
    if (r->started && !r->stopping) {
        pthread_mutex_lock(&r->mu);
        r->stopping = 1;
        pthread_mutex_unlock(&r->mu);
        wake_thread(r);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(r->thread, NULL);
        Py_END_ALLOW_THREADS
    }
}

static PyObject *Relayer_close(Relayer *r, PyObject *Py_UNUSED(ignored)) {
    relayer_stop(r);
    /* Splices the thread stopped or took back and nobody collected: released (their coroutines are woken
       by their connections' failure when the pool closes). Running ones are released by `cancel()`. */
    Py_INCREF(r);
    for (int pass = 0; pass < 2; pass++) {
        Splice *s = pass ? r->retire : r->done;
        if (pass) r->retire = NULL; else r->done = NULL;
        while (s) {
            Splice *n = s->next;
            s->next = NULL;
            s->owner = NULL;
            Py_DECREF(s);
            Py_DECREF(r);
            s = n;
        }
    }
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static void Relayer_dealloc(Relayer *r) {
    relayer_stop(r); /* no splice names it now: each holds a reference while it does */
    if (r->ep >= 0) close(r->ep);
    if (r->wake >= 0) close(r->wake);
    if (r->notify >= 0) close(r->notify);
    pthread_mutex_destroy(&r->mu);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *get_notify(Relayer *r, void *c) { return PyLong_FromLong(r->notify); }

static PyGetSetDef Relayer_getset[] = {
    {"notify_fd", (getter)get_notify, NULL, "readable when splices stopped: call collect()", NULL},
    {NULL},
};

static PyMethodDef Relayer_methods[] = {
    {"add", (PyCFunction)Relayer_add, METH_O, "hand a splice to the relay thread"},
    {"collect", (PyCFunction)Relayer_collect, METH_NOARGS, "report the splices the thread stopped"},
    {"close", (PyCFunction)Relayer_close, METH_NOARGS, "stop the thread (every splice taken back first)"},
    {NULL},
};

static PyTypeObject RelayerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_atomesh_splice.Relayer",
    .tp_basicsize = sizeof(Relayer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "the relay thread of a gateway process",
    .tp_new = Relayer_new,
    .tp_dealloc = (destructor)Relayer_dealloc,
    .tp_methods = Relayer_methods,
    .tp_getset = Relayer_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_atomesh_splice", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__atomesh_splice(void) {
    if (PyType_Ready(&SpliceType) < 0 || PyType_Ready(&RelayerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Splice", (PyObject *)&SpliceType) < 0 ||
        PyModule_AddObjectRef(m, "Relayer", (PyObject *)&RelayerType) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
