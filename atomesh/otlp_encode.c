/* The gateway's OTLP encoder, compiled: a frame of requests' records in, ExportTraceServiceRequests out.

   atomesh/otlp_native.py builds this once (cc, cached under ~/.cache/atomesh) and calls it from the sender
   process; atomesh/otlp.py's SpanEncoder is the same encoder in Python (the fallback) and the reference:
   both write the same bytes for the same frame (tests/test_tracing.py compares them). The record is the one
   atomesh/otlp.py describes, as the gateway `marshal`s it (format 4); this file reads the subset of
   marshal's format those records use. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { V_NONE, V_BOOL, V_INT, V_BYTES, V_STR, V_SEQ, V_FLOAT };

typedef struct {
    uint8_t type;
    uint32_t n;         /* bytes of a string, items of a sequence */
    int64_t i;          /* an int's or bool's value; a sequence's first item in `items` */
    const uint8_t *s;   /* a string's bytes; a float's 8 bytes */
} Val;

typedef struct {
    const uint8_t *p, *end;
    Val *vals;
    uint32_t nvals, capvals;
    uint32_t *items;    /* a sequence's items: indices into vals */
    uint32_t nitems, capitems;
    uint32_t *refs;     /* marshal's back-references: indices into vals */
    uint32_t nrefs, caprefs;
} Reader;

#define BAD UINT32_MAX

static int32_t rd_i32(Reader *r) {
    int32_t v;
    memcpy(&v, r->p, 4);
    r->p += 4;
    return v;
}

static uint32_t new_val(Reader *r, uint8_t type) {
    if (r->nvals == r->capvals)
        return BAD;
    memset(&r->vals[r->nvals], 0, sizeof(Val));
    r->vals[r->nvals].type = type;
    return r->nvals++;
}

static uint32_t read_val(Reader *r, int depth) {
    if (r->p >= r->end || depth > 8)
        return BAD;
    uint8_t code = *r->p++;
    int flag = code & 0x80;
    code &= 0x7f;
    uint32_t ref = 0, v;
    if (flag) { /* the object gets the next back-reference, before its items are read */
        if (r->nrefs == r->caprefs)
            return BAD;
        ref = r->nrefs++;
    }
    switch (code) {
    case 'N':
        v = new_val(r, V_NONE);
        break;
    case 'T':
    case 'F':
        v = new_val(r, V_BOOL);
        if (v != BAD)
            r->vals[v].i = code == 'T';
        break;
    case 'i':
        if (r->end - r->p < 4 || (v = new_val(r, V_INT)) == BAD)
            return BAD;
        r->vals[v].i = rd_i32(r);
        break;
    case 'l': { /* |n| 15-bit digits, least significant first; n's sign is the number's */
        if (r->end - r->p < 4)
            return BAD;
        int32_t n = rd_i32(r);
        uint32_t digits = n < 0 ? (uint32_t)-n : (uint32_t)n;
        if (digits > 5 || (size_t)(r->end - r->p) < 2 * digits || (v = new_val(r, V_INT)) == BAD)
            return BAD;
        uint64_t x = 0;
        for (uint32_t k = 0; k < digits; k++) {
            uint16_t d;
            memcpy(&d, r->p + 2 * k, 2);
            x |= (uint64_t)d << (15 * k);
        }
        r->p += 2 * digits;
        r->vals[v].i = n < 0 ? -(int64_t)x : (int64_t)x;
        break;
    }
    case 'g':
        if (r->end - r->p < 8 || (v = new_val(r, V_FLOAT)) == BAD)
            return BAD;
        r->vals[v].s = r->p;
        r->p += 8;
        break;
    case 's': case 'u': case 't': case 'a': case 'A': case 'z': case 'Z': {
        uint32_t n;
        if (code == 'z' || code == 'Z') {
            if (r->p >= r->end)
                return BAD;
            n = *r->p++;
        } else {
            if (r->end - r->p < 4)
                return BAD;
            n = (uint32_t)rd_i32(r);
        }
        if ((size_t)(r->end - r->p) < n || (v = new_val(r, code == 's' ? V_BYTES : V_STR)) == BAD)
            return BAD;
        r->vals[v].s = r->p;
        r->vals[v].n = n;
        r->p += n;
        break;
    }
    case '(': case ')': case '[': {
        uint32_t n;
        if (code == ')') {
            if (r->p >= r->end)
                return BAD;
            n = *r->p++;
        } else {
            if (r->end - r->p < 4)
                return BAD;
            n = (uint32_t)rd_i32(r);
        }
        if (n > (uint32_t)(r->end - r->p) || r->capitems - r->nitems < n || (v = new_val(r, V_SEQ)) == BAD)
            return BAD;
        uint32_t first = r->nitems;
        r->nitems += n;
        r->vals[v].n = n;
        r->vals[v].i = first;
        if (flag)
            r->refs[ref] = v;
        for (uint32_t k = 0; k < n; k++) {
            uint32_t item = read_val(r, depth + 1);
            if (item == BAD)
                return BAD;
            r->items[first + k] = item;
        }
        return v;
    }
    case 'r': {
        if (r->end - r->p < 4)
            return BAD;
        uint32_t k = (uint32_t)rd_i32(r);
        return k < r->nrefs ? r->refs[k] : BAD;
    }
    default:
        return BAD;
    }
    if (v != BAD && flag)
        r->refs[ref] = v;
    return v;
}

/* ------------------------------------------------------------------ protobuf writing */

typedef struct {
    uint8_t *p, *end;
    int full;
} Out;

static inline void put(Out *o, const void *s, size_t n) {
    if (__builtin_expect((size_t)(o->end - o->p) < n, 0)) {
        o->full = 1;
        o->p = o->end;
        return;
    }
    memcpy(o->p, s, n);
    o->p += n;
}

static inline void put_byte(Out *o, uint8_t b) {
    if (__builtin_expect(o->p < o->end, 1))
        *o->p++ = b;
    else
        o->full = 1;
}

static inline void put_varint(Out *o, uint64_t n) {
    if (n < 0x80) {
        put_byte(o, (uint8_t)n);
        return;
    }
    uint8_t b[10];
    int k = 0;
    while (n >= 0x80) {
        b[k++] = (uint8_t)(n | 0x80);
        n >>= 7;
    }
    b[k++] = (uint8_t)n;
    put(o, b, k);
}

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "fixed64 fields are written as the host's 8 bytes: a little-endian host only"
#endif

static inline void put_u64(Out *o, uint64_t n) { put(o, &n, 8); } /* fixed64 */

static int varint_size(uint64_t n) {
    int k = 1;
    while (n >= 0x80) {
        n >>= 7;
        k++;
    }
    return k;
}

static void put_field(Out *o, uint8_t tag, const void *s, size_t n) {
    put_byte(o, tag);
    put_varint(o, n);
    put(o, s, n);
}


static const Val *item(const Reader *r, const Val *seq, uint32_t k) { return &r->vals[r->items[seq->i + k]]; }

/* An AnyValue's size, and the value as atomesh.otlp.any_value writes it (None as the string "None", as
   `str(v)` does); lengths are computed first, so nothing written is moved. */
static size_t any_size(const Reader *r, const Val *v);

static size_t str_size(size_t n) { return 1 + (size_t)varint_size(n) + n; } /* a tag, a length, the bytes */

static size_t array_size(const Reader *r, const Val *v) { /* ArrayValue: values (1), each an AnyValue */
    size_t n = 0;
    for (uint32_t k = 0; k < v->n; k++)
        n += str_size(any_size(r, item(r, v, k)));
    return n;
}

static size_t any_size(const Reader *r, const Val *v) {
    switch (v->type) {
    case V_BOOL:
        return 2;
    case V_INT:
        return 1 + (size_t)varint_size((uint64_t)v->i);
    case V_FLOAT:
        return 9;
    case V_NONE:
        return str_size(4);
    case V_SEQ:
        return str_size(array_size(r, v));
    default:
        return str_size(v->n);
    }
}

static void put_any(Out *o, const Reader *r, const Val *v) {
    switch (v->type) {
    case V_STR:
    case V_BYTES: /* not in a record's values (`record_at` refuses them) */
        put_field(o, 0x0A, v->s, v->n);
        break;
    case V_BOOL:
        put_byte(o, 0x10);
        put_byte(o, (uint8_t)v->i);
        break;
    case V_INT:
        put_byte(o, 0x18);
        put_varint(o, (uint64_t)v->i);
        break;
    case V_FLOAT:
        put_byte(o, 0x21);
        put(o, v->s, 8);
        break;
    case V_NONE:
        put_field(o, 0x0A, "None", 4);
        break;
    case V_SEQ:
        put_byte(o, 0x2A);
        put_varint(o, array_size(r, v));
        for (uint32_t k = 0; k < v->n; k++) {
            const Val *x = item(r, v, k);
            put_byte(o, 0x0A);
            put_varint(o, any_size(r, x));
            put_any(o, r, x);
        }
        break;
    }
}

static int any_ok(const Reader *r, const Val *v, int depth) {
    if (v->type == V_BYTES || depth > 4)
        return 0;
    if (v->type == V_SEQ)
        for (uint32_t k = 0; k < v->n; k++)
            if (!any_ok(r, item(r, v, k), depth + 1))
                return 0;
    return 1;
}

/* Span.attributes (9): one KeyValue {key (1), value (2)}. */
static void put_attr(Out *o, const Reader *r, const char *key, size_t key_len, const Val *v) {
    size_t value = any_size(r, v);
    put_byte(o, 0x4A);
    put_varint(o, str_size(key_len) + str_size(value));
    put_field(o, 0x0A, key, key_len);
    put_byte(o, 0x12);
    put_varint(o, value);
    put_any(o, r, v);
}

static size_t attr_size(const Reader *r, size_t key_len, const Val *v) {
    return str_size(str_size(key_len) + str_size(any_size(r, v)));
}

#define PUT_ATTR(o, r, key, v) put_attr(o, r, key, sizeof(key) - 1, v)
#define ATTR_SIZE(r, key, v) attr_size(r, sizeof(key) - 1, v)


/* atomesh.otlp.SPANS: each kind of child span's name, OTLP kind, begin event's keys, constant attribute. */
static const struct {
    const char *name;
    uint8_t kind;
    uint32_t nkeys;
    const char *keys[4];
    const char *leg;
} SPANS[] = {
    {"admission", 1, 3, {"atomesh.class", "atomesh.tenant", "gen_ai.request.model"}, NULL},
    {"attempt", 1, 4, {"atomesh.attempt", "atomesh.attempt.kind", "atomesh.placement.policy", "atomesh.placement.workers"}, NULL},
    {"prefill", 3, 1, {"server.address"}, "prefill"},
    {"decode", 3, 1, {"server.address"}, "decode"},
    {"upstream", 3, 1, {"server.address"}, "single"},
};
enum { ADMISSION, ATTEMPT, NKINDS = 5 };
enum { CHILD_IDS = 56, ROOT_IDS = 46 }; /* ids and times: trace, span, parent (a child's), start, end */

static int is_int(const Val *v) { return v->type == V_INT; }

/* Whether two values are equal (as Python's == for the types a record holds, but an int never equals a bool). */
static int same(const Reader *r, const Val *a, const Val *b) {
    if (a == b)
        return 1; /* one object, written once in the frame and referred to after */
    if (a->type != b->type || a->n != b->n)
        return 0;
    switch (a->type) {
    case V_NONE:
        return 1;
    case V_BOOL:
    case V_INT:
        return a->i == b->i;
    case V_FLOAT:
        return memcmp(a->s, b->s, 8) == 0;
    case V_SEQ:
        for (uint32_t k = 0; k < a->n; k++)
            if (!same(r, item(r, a, k), item(r, b, k)))
                return 0;
        return 1;
    default:
        return memcmp(a->s, b->s, a->n) == 0;
    }
}

/* The last span of each kind (and the last request span) written, with what came before its ids: its
   values repeat from request to request (route, model, worker, status), so a span whose values equal the
   last one's copies those bytes instead of writing them again. Kept for one frame (values point into it). */
enum { HEAD_MAX = 480 };
typedef struct {
    const Val *values[NKINDS + 1][5]; /* a child's begin event's values; a request span's (route, model, status, workers, error) */
    uint8_t heads[NKINDS + 1][HEAD_MAX];
    size_t lengths[NKINDS + 1]; /* 0: nothing kept */
} Heads;

/* The ids' head: trace_id (1) and span_id's tag (2), then span_id (an id's bytes are the int's big-endian 8). */
static void put_ids(Out *o, const uint8_t *trace_id, uint64_t span_id) {
    put_byte(o, 0x0A);
    put_byte(o, 0x10);
    put(o, trace_id, 16);
    put_byte(o, 0x12);
    put_byte(o, 0x08);
    put_u64(o, __builtin_bswap64(span_id));
}

/* A record's times: monotonic seconds (floats), written as wall-clock nanoseconds by the frame's anchor,
   anchor_ns + floor((t - anchor) * 1e9 + 0.5), as atomesh/otlp.py computes it (built with
   -ffp-contract=off, so that the product and the sum round as Python's do). */
typedef struct {
    int64_t ns;
    double mono;
} Anchor;

static double float_of(const Val *v) {
    double t;
    memcpy(&t, v->s, 8);
    return t;
}

static uint64_t wall_ns(const Anchor *a, const Val *v) {
    double y = (float_of(v) - a->mono) * 1e9 + 0.5;
    int64_t k = (int64_t)y; /* toward zero; then down to the floor */
    if ((double)k > y)
        k--;
    return (uint64_t)(a->ns + k);
}

/* A time that converts: a float within about 3 years of the anchor (not NaN, not infinite). */
static int time_ok(const Anchor *a, const Val *v) {
    if (v->type != V_FLOAT)
        return 0;
    double d = float_of(v) - a->mono;
    return d > -1e8 && d < 1e8;
}

/* A lower-case hex digit's value, else -1. */
static const int8_t HEX_DIGIT[256] = {
    ['0'] = 1, ['1'] = 2, ['2'] = 3, ['3'] = 4, ['4'] = 5, ['5'] = 6, ['6'] = 7, ['7'] = 8, ['8'] = 9, ['9'] = 10,
    ['a'] = 11, ['b'] = 12, ['c'] = 13, ['d'] = 14, ['e'] = 15, ['f'] = 16,
}; /* the value + 1 (0: not a digit), so that the other 240 entries need not be written */

/* Lower-case hex to bytes: 1 if all `n` bytes' digits are. */
static int unhex(const uint8_t *s, size_t n, uint8_t *out) {
    int bad = 0;
    for (size_t k = 0; k < n; k++) {
        int hi = HEX_DIGIT[s[2 * k]], lo = HEX_DIGIT[s[2 * k + 1]];
        bad |= !hi | !lo;
        out[k] = (uint8_t)((hi - 1) << 4 | (lo - 1));
    }
    return !bad;
}

/* A record's ids: its trace id, and its request span's id (the 7 bytes after the trace id, then a zero). */
typedef struct {
    uint8_t trace_id[16];
    uint64_t base;
    uint8_t parent[8]; /* the client's span, when `has_parent` */
    int has_parent;
} Ids;

static int prefix_ids(const Val *prefix, Ids *ids) {
    uint8_t b[8] = {0};
    if (prefix->type != V_STR || prefix->n != 50 || memcmp(prefix->s, "00-", 3) != 0 || prefix->s[35] != '-')
        return 0;
    if (!unhex(prefix->s + 3, 16, ids->trace_id) || !unhex(prefix->s + 36, 7, b))
        return 0;
    uint64_t base = 0;
    for (int k = 0; k < 8; k++)
        base = base << 8 | b[k];
    ids->base = base;
    return 1;
}

/* One child span's ScopeSpans.spans entry: name, kind, attributes, then ids and times (atomesh.otlp's
   order: a message's fields may come in any order, and the Python encoder caches the first part). `begin`
   is the index of its begin (kind, time, values) in `list`. */
static void put_child(Out *o, const Reader *r, Heads *h, const Val *list, uint32_t begin, const Ids *ids, uint64_t id,
                      uint64_t parent, uint64_t start, uint64_t end) {
    uint32_t kind = (uint32_t)item(r, list, begin)->i, nkeys = SPANS[kind].nkeys;
    int hit = h->lengths[kind] != 0;
    for (uint32_t k = 0; hit && k < nkeys; k++)
        hit = same(r, h->values[kind][k], item(r, list, begin + 2 + k));
    if (hit) {
        put(o, h->heads[kind], h->lengths[kind]);
    } else {
        uint8_t *at = o->p;
        size_t name_len = strlen(SPANS[kind].name), size = str_size(name_len) + 2 + CHILD_IDS;
        for (uint32_t k = 0; k < nkeys; k++)
            size += attr_size(r, strlen(SPANS[kind].keys[k]), item(r, list, begin + 2 + k));
        Val leg = {V_STR, 0, 0, (const uint8_t *)SPANS[kind].leg};
        if (SPANS[kind].leg != NULL) {
            leg.n = (uint32_t)strlen(SPANS[kind].leg);
            size += attr_size(r, sizeof("atomesh.leg") - 1, &leg);
        }
        put_byte(o, 0x12);
        put_varint(o, size);
        put_field(o, 0x2A, SPANS[kind].name, name_len);
        put_byte(o, 0x30);
        put_byte(o, SPANS[kind].kind);
        for (uint32_t k = 0; k < nkeys; k++)
            put_attr(o, r, SPANS[kind].keys[k], strlen(SPANS[kind].keys[k]), item(r, list, begin + 2 + k));
        if (SPANS[kind].leg != NULL)
            PUT_ATTR(o, r, "atomesh.leg", &leg);
        size_t n = (size_t)(o->p - at);
        h->lengths[kind] = 0;
        if (!o->full && n <= HEAD_MAX) {
            memcpy(h->heads[kind], at, n);
            h->lengths[kind] = n;
            for (uint32_t k = 0; k < nkeys; k++)
                h->values[kind][k] = item(r, list, begin + 2 + k);
        }
    }
    put_ids(o, ids->trace_id, id);
    put_byte(o, 0x22);
    put_byte(o, 0x08);
    put_u64(o, __builtin_bswap64(parent));
    put_byte(o, 0x39);
    put_u64(o, start);
    put_byte(o, 0x41);
    put_u64(o, end);
}

/* Where a record is in the batch (a flat list): its first item, its route (the first item after its events),
   its spans. */
typedef struct {
    uint32_t first, tail, spans;
    Ids ids; /* decoded once, when the record is checked */
} Rec;

enum { TAIL = 5 };          /* route, request id, status, error, end */
enum { PREFIX_BYTES = 52 }; /* a record's prefix in the frame: 'z', its length, its 50 characters */

/* The record that starts at item `at` of `list`, checked so that writing it needs no more checks: 1 and
   where it is in `rec` if it is one as atomesh/otlp.py describes, else 0. */
static int record_at(const Reader *r, const Val *list, uint32_t at, const Anchor *a, Rec *rec) {
    uint32_t n = list->n;
    Ids *ids = &rec->ids;
    if (n - at < 3 + TAIL || !prefix_ids(item(r, list, at), ids))
        return 0;
    const Val *parent = item(r, list, at + 1);
    if (parent->type != V_STR || (parent->n != 0 && (parent->n != 16 || !unhex(parent->s, 8, ids->parent))))
        return 0;
    ids->has_parent = parent->n != 0;
    if (!time_ok(a, item(r, list, at + 2)))
        return 0;
    uint32_t k = at + 3, open = 0, spans = 1;
    for (;;) {
        if (n - k < TAIL)
            return 0;
        const Val *e = item(r, list, k);
        if (e->type == V_FLOAT) {
            if (open == 0 || !time_ok(a, e))
                return 0;
            open--;
            k++;
            continue;
        }
        if (e->type != V_INT)
            break; /* the route: the events are over */
        int64_t kind = e->i;
        if (kind < 0 || kind >= NKINDS || n - k < 2 + SPANS[kind].nkeys + TAIL || !time_ok(a, item(r, list, k + 1)))
            return 0;
        for (uint32_t j = 0; j < SPANS[kind].nkeys; j++)
            if (!any_ok(r, item(r, list, k + 2 + j), 0))
                return 0;
        if (kind == ATTEMPT && item(r, list, k + 5)->type != V_SEQ)
            return 0;
        if (kind == ADMISSION && item(r, list, k + 4)->type != V_STR && item(r, list, k + 4)->type != V_NONE)
            return 0;
        open++;
        spans++;
        k += 2 + SPANS[kind].nkeys;
    }
    const Val *error = item(r, list, k + 3);
    if (item(r, list, k)->type != V_STR || item(r, list, k + 1)->type != V_STR || !is_int(item(r, list, k + 2)))
        return 0;
    if ((error->type != V_NONE && error->type != V_STR) || !time_ok(a, item(r, list, k + 4)))
        return 0;
    rec->first = at;
    rec->tail = k;
    rec->spans = spans;
    return 1;
}

/* A request's spans: its children in the order they ended (those left open end with the request), then
   the request span. */
static void put_record(Out *o, const Reader *r, Heads *h, const Val *list, const Rec *rec, const Anchor *a,
                       uint32_t *stack) {
    const Ids *ids = &rec->ids;
    uint64_t base = ids->base;
    const Val *route = item(r, list, rec->tail), *request_id = item(r, list, rec->tail + 1);
    const Val *status_code = item(r, list, rec->tail + 2), *error = item(r, list, rec->tail + 3);
    uint64_t start = wall_ns(a, item(r, list, rec->first + 2)), end = wall_ns(a, item(r, list, rec->tail + 4));
    int64_t status = status_code->i;
    const Val *model = NULL, *workers = NULL;
    uint32_t depth = 0; /* the open spans: their begins' indices, innermost last */
    for (uint32_t k = rec->first + 3; k < rec->tail;) {
        const Val *e = item(r, list, k);
        if (e->type == V_FLOAT) {
            uint32_t j = stack[--depth];
            uint64_t up = depth ? base + (stack[depth - 1] - rec->first) : base;
            put_child(o, r, h, list, j, ids, base + (j - rec->first), up, wall_ns(a, item(r, list, j + 1)),
                      wall_ns(a, e));
            k++;
            continue;
        }
        int64_t kind = e->i;
        if (kind == ATTEMPT)
            workers = item(r, list, k + 5);
        else if (kind == ADMISSION)
            model = item(r, list, k + 4);
        stack[depth++] = k;
        k += 2 + SPANS[kind].nkeys;
    }
    while (depth) {
        uint32_t j = stack[--depth];
        uint64_t up = depth ? base + (stack[depth - 1] - rec->first) : base;
        put_child(o, r, h, list, j, ids, base + (j - rec->first), up, wall_ns(a, item(r, list, j + 1)), end);
    }
    const Val none = {V_NONE, 0, 0, NULL};
    int has_model = model != NULL && model->type == V_STR && model->n, has_workers = workers != NULL && workers->n;
    /* The request span's tail, kept as a child's head is: what follows its ids, up to its request id. */
    const Val *key[5] = {route, has_model ? model : &none, status_code, has_workers ? workers : &none, error};
    int hit = h->lengths[NKINDS] != 0;
    for (int k = 0; hit && k < 5; k++)
        hit = same(r, h->values[NKINDS][k], key[k]);
    size_t tail = h->lengths[NKINDS];
    if (!hit) {
        tail = str_size(5 + route->n) + 2 + (status >= 500 ? 4 : 0);
        tail += ATTR_SIZE(r, "http.route", route) + ATTR_SIZE(r, "http.response.status_code", status_code);
        if (has_model)
            tail += ATTR_SIZE(r, "gen_ai.request.model", model);
        if (has_workers)
            tail += ATTR_SIZE(r, "atomesh.workers", workers);
        if (error->type == V_STR)
            tail += ATTR_SIZE(r, "error.type", error);
    }
    put_byte(o, 0x12);
    put_varint(o, ROOT_IDS + (ids->has_parent ? 10 : 0) + tail + ATTR_SIZE(r, "atomesh.request_id", request_id));
    put_ids(o, ids->trace_id, base);
    put_byte(o, 0x39);
    put_u64(o, start);
    put_byte(o, 0x41);
    put_u64(o, end);
    if (ids->has_parent) {
        put_byte(o, 0x22);
        put_byte(o, 0x08);
        put(o, ids->parent, 8);
    }
    if (hit) {
        put(o, h->heads[NKINDS], tail);
    } else {
        uint8_t *at = o->p;
        put_byte(o, 0x2A);
        put_varint(o, 5 + route->n);
        put(o, "POST ", 5);
        put(o, route->s, route->n);
        put_byte(o, 0x30);
        put_byte(o, 2); /* SPAN_KIND_SERVER */
        PUT_ATTR(o, r, "http.route", route);
        if (has_model)
            PUT_ATTR(o, r, "gen_ai.request.model", model);
        PUT_ATTR(o, r, "http.response.status_code", status_code);
        if (has_workers)
            PUT_ATTR(o, r, "atomesh.workers", workers);
        if (error->type == V_STR)
            PUT_ATTR(o, r, "error.type", error);
        if (status >= 500)
            put(o, "\x7a\x02\x18\x02", 4); /* status (15) { code (3): STATUS_CODE_ERROR } */
        h->lengths[NKINDS] = 0;
        if (!o->full && tail <= HEAD_MAX) {
            memcpy(h->heads[NKINDS], at, tail);
            h->lengths[NKINDS] = tail;
            for (int k = 0; k < 5; k++)
                h->values[NKINDS][k] = key[k];
        }
    }
    PUT_ATTR(o, r, "atomesh.request_id", request_id);
}

/* Encodes a frame (a marshalled (anchor_ns, anchor, batch), atomesh/otlp.py) in export batches of at most
   `max_spans` spans (a request's spans together), each an ExportTraceServiceRequest: resource_spans (1) {
   resource, scope_spans (2) { scope, spans } }, `resource` and `scope` being those fields already written.
   Batch k is out[starts[k] : ends[k]]. Returns the number of batches; -1 when `out` is too small, -3 when
   there are more than `max_batches` (call again with more room), -2 when the frame is not one of records. */
long atomesh_otlp_encode(const uint8_t *frame, long frame_len, const uint8_t *resource, long resource_len,
                         const uint8_t *scope, long scope_len, long max_spans, uint8_t *out, long out_len,
                         long *starts, long *ends, long max_batches) {
    /* Every value takes at least one byte of the frame, and a record more than PREFIX_BYTES (its prefix).
       The arrays are kept from call to call (fresh ones for each frame would cost page faults as large as
       the encoding): one caller at a time. */
    static Val *vals;
    static uint32_t *items, *refs, *stack, cap;
    static Rec *recs;
    long batches = -2;
    if ((uint64_t)frame_len + 1 > UINT32_MAX - 1)
        return batches;
    if (cap < (uint32_t)frame_len + 1) {
        free(vals);
        free(items);
        free(refs);
        free(stack);
        free(recs);
        cap = (uint32_t)frame_len + 1;
        vals = malloc(sizeof(Val) * cap);
        items = malloc(sizeof(uint32_t) * cap);
        refs = malloc(sizeof(uint32_t) * cap);
        stack = malloc(sizeof(uint32_t) * cap);
        recs = malloc(sizeof(Rec) * (cap / PREFIX_BYTES + 1));
        if (vals == NULL || items == NULL || refs == NULL || stack == NULL || recs == NULL) {
            cap = 0;
            return batches;
        }
    }
    Reader r = {frame, frame + frame_len, vals, 0, cap, items, 0, cap, refs, 0, cap};
    uint32_t top = read_val(&r, 0);
    if (top == BAD || r.p != r.end || r.vals[top].type != V_SEQ || r.vals[top].n != 3)
        goto done;
    const Val *anchor_ns = item(&r, &r.vals[top], 0), *anchor = item(&r, &r.vals[top], 1);
    const Val *list = item(&r, &r.vals[top], 2);
    if (!is_int(anchor_ns) || anchor->type != V_FLOAT || list->type != V_SEQ)
        goto done;
    Anchor a = {anchor_ns->i, float_of(anchor)};
    uint32_t nrecs = 0;
    for (uint32_t at = 0; at < list->n; at = recs[nrecs++].tail + TAIL)
        if (nrecs == cap / PREFIX_BYTES + 1 || !record_at(&r, list, at, &a, &recs[nrecs]))
            goto done; /* (more records than prefixes fit: some were back-references, which the gateway never writes) */
    Out o = {out, out + out_len, 0};
    static Heads heads; /* about 3 KB: kept static, not on the stack; reset for each frame */
    memset(heads.lengths, 0, sizeof(heads.lengths));
    batches = 0;
    uint32_t k = 0;
    while (k < nrecs) {
        if (batches == max_batches) {
            batches = -3;
            goto done;
        }
        /* The spans first, after room for what goes before them (a batch's bytes must not move: it
           is about 400 KB); then that, written back from the first span. */
        size_t room = 12 + (size_t)resource_len + (size_t)scope_len;
        if ((size_t)(o.end - o.p) < room) {
            batches = -1;
            goto done;
        }
        uint8_t *first = o.p += room;
        long spans = 0;
        do {
            spans += recs[k].spans;
            put_record(&o, &r, &heads, list, &recs[k], &a, stack);
            k++;
        } while (k < nrecs && spans + recs[k].spans <= max_spans);
        if (o.full) {
            batches = -1;
            goto done;
        }
        size_t scope_spans = (size_t)scope_len + (size_t)(o.p - first);
        size_t request = (size_t)resource_len + 1 + (size_t)varint_size(scope_spans) + scope_spans;
        uint8_t *head = first - (1 + (size_t)varint_size(request) + (size_t)resource_len + 1 +
                                 (size_t)varint_size(scope_spans) + (size_t)scope_len);
        Out h = {head, first, 0};
        put_byte(&h, 0x0A); /* ExportTraceServiceRequest.resource_spans (1) */
        put_varint(&h, request);
        put(&h, resource, (size_t)resource_len);
        put_byte(&h, 0x12); /* ResourceSpans.scope_spans (2) */
        put_varint(&h, scope_spans);
        put(&h, scope, (size_t)scope_len);
        starts[batches] = head - out;
        ends[batches] = o.p - out;
        batches++;
    }
done:
    return batches;
}
