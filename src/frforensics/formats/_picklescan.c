/* frforensics.formats._picklescan: PyTorch's native pickle dumps read into columns
 * without building the document.
 *
 * pickle.loads of a 2000-entry dump builds ~100,000 Python objects (a dict per
 * entry, lists of shapes, frame dicts...), which the reader then walks once to
 * pull columns out and frees again: ~10 ms per rank, of which the columns need a
 * few integers. This module runs the pickle opcode stream itself, in C:
 *
 *   scan(data) -> dict | str | None
 *
 * The stream is executed into an arena of tagged nodes (no Python objects; the
 * memo holds node ids, so memoized strings, frame dicts and lists are shared
 * exactly as the pickle says), then the "entries" list is read into column
 * arrays and everything else at the top level is converted to Python objects
 * (pg_config, version... a few dozen objects). Strings are interned by content
 * once each; frames and stacks are deduplicated by content.
 *
 * It only ever answers for the *regular* document that the Python column reader
 * (formats/native.py, _columns_bulk) accepts, with the same values: every entry
 * a dict holding every field that reader needs, with the types it expects (or a
 * numeric string in an integer field, which both read as its integer). On
 * anything else -- an opcode outside the plain-builtins subset (globals, reduce,
 * persistent ids, sets, bytes...), a truncated or malformed stream, an odd type,
 * a missing field, invalid UTF-8 -- it returns None and the caller decodes the
 * file with the safe Python unpickler, which decides what is malformed and says
 * so. So this module can make a dump faster to read, never readable when it was
 * not, and it runs no code: there is no opcode here that reaches a global.
 *
 * The one exception: a stream that is certainly malformed where the unpickler
 * would fail the same way (truncated, stack underflow, a memo key never set, no
 * STOP) gives a str saying why, so the caller need not run the unpickler to
 * learn it; so does a memo index past the size of the file, which no writer
 * produces and which would make the unpickler allocate gigabytes first.
 *
 * Returned dict (n = number of entries, arrays as bytearrays of native-endian
 * values, string ids index "strings"):
 *   doc            the top-level dict without "entries" (Python objects)
 *   n, strings     entry count; list of every distinct string
 *   i32 columns    pg_name, pg_desc, profiling_name, state, in_dtypes,
 *                  out_dtypes, thread, in_sizes, out_sizes (str() of the sizes),
 *                  stack (index into the stack table, -1 = no frames)
 *   i64 columns    in_numel, out_numel, record_id, seq, p2p_seq, t_enqueue,
 *                  t_start, t_complete, timeout_ms, duration (ns, -1 = unknown)
 *   u8 columns     is_p2p, retired
 *   string_ints    bit k set: integer column record_id + k (INT_KEYS order) held
 *                  numeric strings somewhere, read as their integers (as the
 *                  Python reader's lenient_ints, which notes it)
 *   frame table    frame_file, frame_name (i32 string ids), frame_line (i64)
 *   stack table    stack_offsets (i32, n_stacks + 1), stack_frames (i32 frame ids)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Dumps past this size are left to the Python unpickler (the node arena would be
 * ~30 bytes per opcode; real dumps are a few MB). */
#define MAX_SCAN_BYTES ((Py_ssize_t)256 << 20)
#define MAX_DEPTH 64
/* a lookup that probes this many slots gives way to the Python reader (its dicts'
 * hash is randomized): tables stay at most half full, so only input crafted to
 * collide gets here, and it must not cost a probe per string already seen */
#define MAX_PROBES 128
#define MAX_ENTRY_KEYS 128 /* PyTorch's entries have ~25 */
#define NUMEL_LIMIT 4611686018427387904.0 /* 2**62, as the Python reader */

enum { T_NONE, T_BOOL, T_INT, T_FLOAT, T_STR, T_BIGINT, T_LIST, T_TUPLE, T_DICT };

typedef struct {
    int64_t v; /* int, bool, string id, or the bits of a double */
    int32_t head, tail, count;
    uint8_t tag;
} Node;

typedef struct {
    int32_t node, next;
} Link;

typedef struct {
    int32_t *slot;
    uint64_t mask;
    int32_t count;
} IdTab;

/* Growable array of fixed-size items. */
typedef struct {
    char *p;
    Py_ssize_t n, cap, size;
} Vec;

#define VEC(T) ((T *)v.p)

typedef struct ArenaChunk {
    struct ArenaChunk *next;
    char data[];
} ArenaChunk;

enum {
    K_PROCESS_GROUP, K_PROFILING_NAME, K_IS_P2P, K_INPUT_SIZES, K_OUTPUT_SIZES,
    K_INPUT_DTYPES, K_STATE, K_RETIRED, K_RECORD_ID, K_COLLECTIVE_SEQ_ID, K_P2P_SEQ_ID,
    K_TIME_CREATED, K_TIME_STARTED, K_TIME_COMPLETED, K_TIMEOUT_MS,
    N_REQUIRED,
    K_OUTPUT_DTYPES = N_REQUIRED, K_THREAD_NAME, K_FRAMES, K_DURATION,
    N_ENTRY_KEYS,
    K_FILENAME = N_ENTRY_KEYS, K_LINE, K_NAME, K_ENTRIES, K_EMPTY,
    N_KEYS
};

static const char *const KEY_NAMES[N_KEYS] = {
    "process_group", "profiling_name", "is_p2p", "input_sizes", "output_sizes",
    "input_dtypes", "state", "retired", "record_id", "collective_seq_id", "p2p_seq_id",
    "time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns",
    "timeout_ms", "output_dtypes", "thread_name", "frames", "duration_ms", "filename", "line",
    "name", "entries", "",
};

typedef struct {
    const unsigned char *data;
    Py_ssize_t len;
    Vec nodes, links, stack, marks, memo;
    /* memo slots filled: where MEMOIZE stores (pickle's len(memo), not a count of
     * MEMOIZE opcodes: a stream may mix them with BINPUT) */
    Py_ssize_t memo_len;
    /* strings */
    Vec sptr, slen, shash;
    IdTab stab;
    PyObject *pystrings;
    ArenaChunk *arena;
    Py_ssize_t arena_left;
    char *arena_at;
    /* frames and stacks */
    Vec f_file, f_name, f_line, f_hash;
    IdTab ftab;
    Vec st_off, st_flat, st_hash;
    IdTab sttab;
    int32_t *node_fid, *node_stid;
    /* per-node memos: what a node shared through the pickle's memo (or DUP)
     * means is computed once, as pickle itself builds a memoized object once;
     * so a small pickle referencing one big list many times costs its size,
     * never the product */
    PyObject **node_py; /* to_py */
    Py_ssize_t n_py;
    int32_t *node_sz;   /* read_sizes: index into the sz_* vectors, -1 = not yet */
    int32_t *node_dt;   /* read_dtypes: string id, -1 = not yet */
    Vec sz_numel, sz_fsum, sz_text;
    /* limits (formats/limits.py); past them: irregular, the Python reader decides */
    Py_ssize_t max_dims, max_text_dims, max_string, max_entries;
    /* bytes of the texts built from the document (shapes, dtype lists), new ones
     * only: memo references let a small file build each entry's text from one long
     * string, so the total is bounded (the caller's budget) */
    Py_ssize_t built, max_built;
    /* scratch */
    Vec text, fids;
    const unsigned char *op_at; /* the opcode being run */
    char why[160];
} Scan;


/* status codes: OK, IRREGULAR (answer None), ERR (a Python exception is set) */
#define OK 0
#define IRREGULAR 1
#define ERR (-1)
#define CORRUPT 2 /* certainly malformed: s->why says how (the unpickler would fail too) */
#define TOO_MANY 3 /* a caller's limit (entries, built text): refused, s->why says which */
#define TRY(x) do { int rc_ = (x); if (rc_ != OK) return rc_; } while (0)

static int corrupt(Scan *s, const char *what) {
    snprintf(s->why, sizeof s->why, "%s at byte %lld", what,
             (long long)(s->op_at ? s->op_at - s->data : 0));
    return CORRUPT;
}

static int vec_init(Vec *v, Py_ssize_t size, Py_ssize_t cap) {
    v->size = size;
    v->n = 0;
    v->cap = cap;
    v->p = PyMem_Malloc((size_t)(cap * size));
    if (v->p == NULL) {
        PyErr_NoMemory();
        return ERR;
    }
    return OK;
}

static int vec_reserve(Vec *v, Py_ssize_t extra) {
    if (v->n + extra <= v->cap)
        return OK;
    Py_ssize_t cap = v->cap * 2;
    while (cap < v->n + extra)
        cap *= 2;
    if (cap > PY_SSIZE_T_MAX / v->size / 2) {
        PyErr_NoMemory();
        return ERR;
    }
    char *p = PyMem_Realloc(v->p, (size_t)(cap * v->size));
    if (p == NULL) {
        PyErr_NoMemory();
        return ERR;
    }
    v->p = p;
    v->cap = cap;
    return OK;
}

static void vec_free(Vec *v) {
    PyMem_Free(v->p);
    v->p = NULL;
}

#define AT(vec, T, i) (((T *)(vec).p)[i])

/* FNV-1a over 8-byte words, then the tail bytes, then a final mix (the hash only
 * has to agree with itself within one scan). A byte at a time was a tenth of
 * the scan: every string, frame and stack is hashed when first met. */
static inline uint64_t hash_bytes(const void *p, Py_ssize_t n, uint64_t h) {
    const unsigned char *s = p;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, s + i, 8);
        h ^= w;
        h *= 1099511628211ULL;
        h ^= h >> 29;
    }
    for (; i < n; i++) {
        h ^= s[i];
        h *= 1099511628211ULL;
    }
    h ^= (uint64_t)n;
    h ^= h >> 32;
    h *= 0x9E3779B97F4A7C15ULL;
    return h ^ (h >> 29);
}
#define HASH_SEED 14695981039346656037ULL

static int idtab_init(IdTab *t, uint64_t cap) {
    t->slot = PyMem_Malloc(cap * sizeof(int32_t));
    if (t->slot == NULL) {
        PyErr_NoMemory();
        return ERR;
    }
    memset(t->slot, 0xff, cap * sizeof(int32_t));
    t->mask = cap - 1;
    t->count = 0;
    return OK;
}

/* Double the table when half full; `hashes` gives the hash of every id. */
static int idtab_grow(IdTab *t, const uint64_t *hashes) {
    if ((uint64_t)(t->count + 1) * 2 <= t->mask + 1)
        return OK;
    uint64_t cap = (t->mask + 1) * 2;
    int32_t *slot = PyMem_Malloc(cap * sizeof(int32_t));
    if (slot == NULL) {
        PyErr_NoMemory();
        return ERR;
    }
    memset(slot, 0xff, cap * sizeof(int32_t));
    for (uint64_t i = 0; i <= t->mask; i++) {
        int32_t id = t->slot[i];
        if (id < 0)
            continue;
        uint64_t j = hashes[id] & (cap - 1);
        while (slot[j] >= 0)
            j = (j + 1) & (cap - 1);
        slot[j] = id;
    }
    PyMem_Free(t->slot);
    t->slot = slot;
    t->mask = cap - 1;
    return OK;
}

/* ---- strings ------------------------------------------------------------- */

static char *arena_copy(Scan *s, const char *p, Py_ssize_t n) {
    if (n > s->arena_left) {
        Py_ssize_t size = n > 65536 ? n : 65536;
        ArenaChunk *c = PyMem_Malloc(sizeof(ArenaChunk) + (size_t)size);
        if (c == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        c->next = s->arena;
        s->arena = c;
        s->arena_at = c->data;
        s->arena_left = size;
    }
    char *out = s->arena_at;
    memcpy(out, p, (size_t)n);
    s->arena_at += n;
    s->arena_left -= n;
    return out;
}

/* The id of the string with these UTF-8 bytes (added on first sight). `stable`
 * says p outlives the scan (it points into the pickle); others are copied. */
static int intern(Scan *s, const char *p, Py_ssize_t n, int stable, int32_t *out) {
    if (n > INT32_MAX || n > s->max_string)
        return IRREGULAR; /* the Python reader cuts long strings */
    uint64_t h = hash_bytes(p, n, HASH_SEED);
    uint64_t i = h & s->stab.mask;
    for (int probes = 0;; probes++) {
        if (probes == MAX_PROBES)
            return IRREGULAR;
        int32_t id = s->stab.slot[i];
        if (id < 0)
            break;
        if (AT(s->shash, uint64_t, id) == h && AT(s->slen, int32_t, id) == n
            && memcmp(AT(s->sptr, const char *, id), p, (size_t)n) == 0) {
            *out = id;
            return OK;
        }
        i = (i + 1) & s->stab.mask;
    }
    if (!stable) {
        if (n > s->max_built - s->built) {
            snprintf(s->why, sizeof s->why,
                     "its entries build more than %zd characters of text (shapes, dtype "
                     "lists: the limit for a file of %zd bytes)", s->max_built, s->len);
            return TOO_MANY;
        }
        s->built += n;
    }
    /* new: must be valid UTF-8 for Python's unpickler (errors="surrogatepass") */
    PyObject *str = PyUnicode_DecodeUTF8(p, n, "surrogatepass");
    if (str == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            PyErr_Clear();
            return IRREGULAR;
        }
        return ERR;
    }
    int rc = PyList_Append(s->pystrings, str);
    Py_DECREF(str);
    if (rc < 0)
        return ERR;
    if (!stable && (p = arena_copy(s, p, n)) == NULL)
        return ERR;
    int32_t id = (int32_t)s->sptr.n;
    TRY(vec_reserve(&s->sptr, 1));
    TRY(vec_reserve(&s->slen, 1));
    TRY(vec_reserve(&s->shash, 1));
    AT(s->sptr, const char *, s->sptr.n++) = p;
    AT(s->slen, int32_t, s->slen.n++) = (int32_t)n;
    AT(s->shash, uint64_t, s->shash.n++) = h;
    s->stab.slot[i] = id;
    s->stab.count++;
    TRY(idtab_grow(&s->stab, (const uint64_t *)s->shash.p));
    *out = id;
    return OK;
}

/* ---- the opcode machine ------------------------------------------------- */

static int new_node(Scan *s, uint8_t tag, int64_t v, int32_t *out) {
    TRY(vec_reserve(&s->nodes, 1));
    Node *nd = &AT(s->nodes, Node, s->nodes.n);
    nd->tag = tag;
    nd->v = v;
    nd->head = nd->tail = -1;
    nd->count = 0;
    *out = (int32_t)s->nodes.n++;
    return OK;
}

static int link_child(Scan *s, int32_t parent, int32_t child) {
    TRY(vec_reserve(&s->links, 1));
    int32_t l = (int32_t)s->links.n++;
    AT(s->links, Link, l).node = child;
    AT(s->links, Link, l).next = -1;
    Node *p = &AT(s->nodes, Node, parent);
    if (p->tail >= 0)
        AT(s->links, Link, p->tail).next = l;
    else
        p->head = l;
    p->tail = l;
    if (p->count == INT32_MAX)
        return IRREGULAR;
    p->count++;
    return OK;
}

static inline Py_ssize_t fence(Scan *s) {
    return s->marks.n ? AT(s->marks, Py_ssize_t, s->marks.n - 1) : 0;
}

static int push(Scan *s, int32_t node) {
    TRY(vec_reserve(&s->stack, 1));
    AT(s->stack, int32_t, s->stack.n++) = node;
    return OK;
}

static int push_new(Scan *s, uint8_t tag, int64_t v) {
    int32_t id;
    TRY(new_node(s, tag, v, &id));
    return push(s, id);
}

static int pop_mark(Scan *s, Py_ssize_t *mark) {
    if (s->marks.n == 0)
        return corrupt(s, "no MARK for this opcode");
    *mark = AT(s->marks, Py_ssize_t, --s->marks.n);
    return OK;
}

/* Items stack[mark:] become children of `parent` (pairs for a dict). */
static int take_items(Scan *s, int32_t parent, Py_ssize_t mark) {
    for (Py_ssize_t k = mark; k < s->stack.n; k++)
        TRY(link_child(s, parent, AT(s->stack, int32_t, k)));
    s->stack.n = mark;
    return OK;
}

static int memo_put(Scan *s, uint64_t idx) {
    if (s->stack.n <= fence(s))
        return corrupt(s, "stack underflow");
    /* writers number memo entries from 0; an index past the file's size would
     * make the unpickler allocate gigabytes */
    if (idx > (uint64_t)s->len)
        return corrupt(s, "memo index past the size of the file");
    if ((Py_ssize_t)idx >= s->memo.n) {
        TRY(vec_reserve(&s->memo, (Py_ssize_t)idx + 1 - s->memo.n));
        for (Py_ssize_t k = s->memo.n; k <= (Py_ssize_t)idx; k++)
            AT(s->memo, int32_t, k) = -1;
        s->memo.n = (Py_ssize_t)idx + 1;
    }
    if (AT(s->memo, int32_t, idx) < 0)
        s->memo_len++;
    AT(s->memo, int32_t, idx) = AT(s->stack, int32_t, s->stack.n - 1);
    return OK;
}

static int memo_get(Scan *s, uint64_t idx) {
    if ((Py_ssize_t)idx >= s->memo.n || AT(s->memo, int32_t, idx) < 0)
        return corrupt(s, "memo value not found");
    return push(s, AT(s->memo, int32_t, idx));
}

static inline uint64_t le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static int run(Scan *s, int32_t *result) {
    const unsigned char *p = s->data, *end = s->data + s->len;
#define NEED(k) do { if ((uint64_t)(end - p) < (uint64_t)(k)) return corrupt(s, "truncated"); } while (0)
#define POP(var) do { if (s->stack.n <= fence(s)) return corrupt(s, "stack underflow"); \
                      var = AT(s->stack, int32_t, --s->stack.n); } while (0)
    while (p < end) {
        s->op_at = p;
        unsigned char op = *p++;
        int32_t a, b, c, id;
        Py_ssize_t mark;
        uint64_t n;
        switch (op) {
        case 0x80: /* PROTO */
            NEED(1);
            if (*p > 5)
                return corrupt(s, "unsupported pickle protocol");
            p++;
            break;
        case 0x95: /* FRAME: the next n bytes must be there */
            NEED(8);
            n = le(p, 8);
            p += 8;
            NEED(n);
            break;
        case '.': /* STOP */
            POP(a);
            *result = a;
            return OK;
        case '(': /* MARK */
            TRY(vec_reserve(&s->marks, 1));
            AT(s->marks, Py_ssize_t, s->marks.n++) = s->stack.n;
            break;
        case '0': /* POP */
            if (s->stack.n > fence(s))
                s->stack.n--;
            else if (s->marks.n)
                s->stack.n = AT(s->marks, Py_ssize_t, --s->marks.n);
            else
                return corrupt(s, "stack underflow");
            break;
        case '1': /* POP_MARK */
            TRY(pop_mark(s, &mark));
            s->stack.n = mark;
            break;
        case '2': /* DUP */
            if (s->stack.n <= fence(s))
                return corrupt(s, "stack underflow");
            TRY(push(s, AT(s->stack, int32_t, s->stack.n - 1)));
            break;
        case 'N':
            TRY(push_new(s, T_NONE, 0));
            break;
        case 0x88: /* NEWTRUE */
            TRY(push_new(s, T_BOOL, 1));
            break;
        case 0x89: /* NEWFALSE */
            TRY(push_new(s, T_BOOL, 0));
            break;
        case 'J': /* BININT */
            NEED(4);
            TRY(push_new(s, T_INT, (int64_t)(int32_t)(uint32_t)le(p, 4)));
            p += 4;
            break;
        case 'K': /* BININT1 */
            NEED(1);
            TRY(push_new(s, T_INT, p[0]));
            p += 1;
            break;
        case 'M': /* BININT2 */
            NEED(2);
            TRY(push_new(s, T_INT, (int64_t)le(p, 2)));
            p += 2;
            break;
        case 0x8a: /* LONG1 */
        case 0x8b: /* LONG4 */
            if (op == 0x8a) {
                NEED(1);
                n = *p++;
            } else {
                NEED(4);
                int32_t n4 = (int32_t)(uint32_t)le(p, 4);
                if (n4 < 0)
                    return corrupt(s, "LONG pickle has negative byte count");
                n = (uint64_t)n4;
                p += 4;
            }
            NEED(n);
            if (n == 0) {
                TRY(push_new(s, T_INT, 0));
            } else if (n <= 8) {
                uint64_t v = le(p, (int)n);
                if (n < 8 && (p[n - 1] & 0x80))
                    v |= ~(uint64_t)0 << (8 * n); /* sign-extend */
                TRY(push_new(s, T_INT, (int64_t)v));
            } else {
                /* more than 8 bytes: still an int64 where every byte past the 8th
                 * only extends the sign (a writer's non-minimal encoding) */
                unsigned char ext = (p[7] & 0x80) ? 0xff : 0x00;
                uint64_t k = 8;
                while (k < n && p[k] == ext)
                    k++;
                if (k == n)
                    TRY(push_new(s, T_INT, (int64_t)le(p, 8)));
                else
                    TRY(push_new(s, T_BIGINT, 0));
            }
            p += n;
            break;
        case 'G': { /* BINFLOAT, big-endian */
            NEED(8);
            uint64_t bits = 0;
            for (int i = 0; i < 8; i++)
                bits = (bits << 8) | p[i];
            p += 8;
            TRY(push_new(s, T_FLOAT, (int64_t)bits));
            break;
        }
        case 'X': /* BINUNICODE */
        case 0x8c: /* SHORT_BINUNICODE */
        case 0x8d: /* BINUNICODE8 */
            if (op == 'X') {
                NEED(4);
                n = le(p, 4);
                p += 4;
            } else if (op == 0x8c) {
                NEED(1);
                n = *p++;
            } else {
                NEED(8);
                n = le(p, 8);
                p += 8;
            }
            NEED(n);
            TRY(intern(s, (const char *)p, (Py_ssize_t)n, 1, &id));
            p += n;
            TRY(push_new(s, T_STR, id));
            break;
        case ']': /* EMPTY_LIST */
            TRY(push_new(s, T_LIST, 0));
            break;
        case ')': /* EMPTY_TUPLE */
            TRY(push_new(s, T_TUPLE, 0));
            break;
        case '}': /* EMPTY_DICT */
            TRY(push_new(s, T_DICT, 0));
            break;
        case 'a': /* APPEND */
            POP(a);
            if (s->stack.n <= fence(s))
                return IRREGULAR;
            b = AT(s->stack, int32_t, s->stack.n - 1);
            if (AT(s->nodes, Node, b).tag != T_LIST)
                return IRREGULAR;
            TRY(link_child(s, b, a));
            break;
        case 'e': /* APPENDS */
        case 'u': /* SETITEMS */
            TRY(pop_mark(s, &mark));
            if (mark < 1 || mark - 1 < fence(s) || mark > s->stack.n)
                return IRREGULAR;
            b = AT(s->stack, int32_t, mark - 1);
            if (AT(s->nodes, Node, b).tag != (op == 'e' ? T_LIST : T_DICT))
                return IRREGULAR;
            if (op == 'u' && (s->stack.n - mark) % 2)
                return IRREGULAR;
            TRY(take_items(s, b, mark));
            break;
        case 's': /* SETITEM */
            POP(a);
            POP(c);
            if (s->stack.n <= fence(s))
                return IRREGULAR;
            b = AT(s->stack, int32_t, s->stack.n - 1);
            if (AT(s->nodes, Node, b).tag != T_DICT)
                return IRREGULAR;
            TRY(link_child(s, b, c));
            TRY(link_child(s, b, a));
            break;
        case 'l': /* LIST */
        case 't': /* TUPLE */
        case 'd': /* DICT */
            TRY(pop_mark(s, &mark));
            if (mark > s->stack.n || (op == 'd' && (s->stack.n - mark) % 2))
                return IRREGULAR;
            TRY(new_node(s, op == 'l' ? T_LIST : op == 't' ? T_TUPLE : T_DICT, 0, &id));
            TRY(take_items(s, id, mark));
            TRY(push(s, id));
            break;
        case 0x85: /* TUPLE1 */
        case 0x86: /* TUPLE2 */
        case 0x87: { /* TUPLE3 */
            Py_ssize_t k = op - 0x84;
            if (s->stack.n - fence(s) < k)
                return IRREGULAR;
            TRY(new_node(s, T_TUPLE, 0, &id));
            TRY(take_items(s, id, s->stack.n - k));
            TRY(push(s, id));
            break;
        }
        case 'q': /* BINPUT */
            NEED(1);
            TRY(memo_put(s, *p++));
            break;
        case 'r': /* LONG_BINPUT */
            NEED(4);
            TRY(memo_put(s, le(p, 4)));
            p += 4;
            break;
        case 0x94: /* MEMOIZE */
            TRY(memo_put(s, (uint64_t)s->memo_len));
            break;
        case 'h': /* BINGET */
            NEED(1);
            TRY(memo_get(s, *p++));
            break;
        case 'j': /* LONG_BINGET */
            NEED(4);
            TRY(memo_get(s, le(p, 4)));
            p += 4;
            break;
        default:
            /* globals, reduce, build, persistent ids, sets, bytes, protocol-0
             * text opcodes...: the Python unpickler's business */
            return IRREGULAR;
        }
    }
    s->op_at = end;
    return corrupt(s, "truncated (no STOP opcode)");
#undef NEED
#undef POP
}

/* ---- reading the entries ------------------------------------------------ */

static inline Node *N(Scan *s, int32_t id) { return &AT(s->nodes, Node, id); }

static int text_add(Scan *s, const char *p, Py_ssize_t n) {
    TRY(vec_reserve(&s->text, n));
    memcpy(s->text.p + s->text.n, p, (size_t)n);
    s->text.n += n;
    return OK;
}

/* decimal digits of a non-negative integer */
static int text_int(Scan *s, int64_t v) {
    char buf[24];
    int k = sizeof buf;
    uint64_t u = (uint64_t)v;
    do {
        buf[--k] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    return text_add(s, buf + k, (Py_ssize_t)sizeof buf - k);
}

static int text_intern(Scan *s, int32_t *out) {
    return intern(s, s->text.p, s->text.n, 0, out);
}

/* str() of a list of shapes, and the elements it holds (as the Python reader). */
static int read_sizes_once(Scan *s, int32_t node, int64_t *numel, double *fsum, int32_t *text);

static int read_sizes(Scan *s, int32_t node, int64_t *numel, double *column_sum, int32_t *text) {
    int32_t k = s->node_sz[node];
    if (k < 0) {
        int64_t nm;
        double fs = 0.0;
        int32_t tx;
        TRY(read_sizes_once(s, node, &nm, &fs, &tx));
        TRY(vec_reserve(&s->sz_numel, 1));
        TRY(vec_reserve(&s->sz_fsum, 1));
        TRY(vec_reserve(&s->sz_text, 1));
        k = s->node_sz[node] = (int32_t)s->sz_numel.n;
        AT(s->sz_numel, int64_t, s->sz_numel.n++) = nm;
        AT(s->sz_fsum, double, s->sz_fsum.n++) = fs;
        AT(s->sz_text, int32_t, s->sz_text.n++) = tx;
    }
    *numel = AT(s->sz_numel, int64_t, k);
    *text = AT(s->sz_text, int32_t, k);
    *column_sum += AT(s->sz_fsum, double, k);
    if (*column_sum >= NUMEL_LIMIT)
        return IRREGULAR;
    return OK;
}

static int read_sizes_once(Scan *s, int32_t node, int64_t *numel, double *column_sum, int32_t *text) {
    Node *nd = N(s, node);
    if (nd->tag != T_LIST && nd->tag != T_TUPLE)
        return IRREGULAR;
    Py_ssize_t dims = 0;
    int outer_tuple = nd->tag == T_TUPLE;
    s->text.n = 0;
    TRY(text_add(s, outer_tuple ? "(" : "[", 1));
    int64_t total = 0;
    int first = 1;
    for (int32_t l = nd->head; l >= 0; l = AT(s->links, Link, l).next) {
        Node *shape = N(s, AT(s->links, Link, l).node);
        if (shape->tag != T_LIST && shape->tag != T_TUPLE)
            return IRREGULAR;
        /* dims per shape, and dims in the text: past the limits, the Python reader */
        dims += shape->count;
        if (shape->count > s->max_dims || dims > s->max_text_dims)
            return IRREGULAR;
        int tuple = shape->tag == T_TUPLE;
        if (!first)
            TRY(text_add(s, ", ", 2));
        first = 0;
        TRY(text_add(s, tuple ? "(" : "[", 1));
        int64_t prod = 1;
        double fprod = 1.0;
        int dfirst = 1;
        for (int32_t m = shape->head; m >= 0; m = AT(s->links, Link, m).next) {
            Node *dim = N(s, AT(s->links, Link, m).node);
            if (dim->tag != T_INT || dim->v < 0)
                return IRREGULAR; /* bools, floats, huge or negative dims */
            fprod *= (double)dim->v;
            if (fprod >= NUMEL_LIMIT)
                return IRREGULAR;
            prod *= dim->v;
            if (!dfirst)
                TRY(text_add(s, ", ", 2));
            TRY(text_int(s, dim->v));
            dfirst = 0;
        }
        if (tuple && shape->count == 1)
            TRY(text_add(s, ",", 1));
        TRY(text_add(s, tuple ? ")" : "]", 1));
        total += prod;
        *column_sum += fprod;
        if (*column_sum >= NUMEL_LIMIT)
            return IRREGULAR;
    }
    if (outer_tuple && nd->count == 1)
        TRY(text_add(s, ",", 1));
    TRY(text_add(s, outer_tuple ? ")" : "]", 1));
    *numel = total;
    return text_intern(s, text);
}

/* ",".join(dtypes); None (where allowed) and empty give "". */
static int read_dtypes(Scan *s, int32_t node, int none_ok, int32_t *out) {
    Node *nd = N(s, node);
    if (nd->tag == T_NONE && none_ok) {
        *out = K_EMPTY;
        return OK;
    }
    if (nd->tag != T_LIST && nd->tag != T_TUPLE)
        return IRREGULAR;
    if (s->node_dt[node] >= 0) {
        *out = s->node_dt[node];
        return OK;
    }
    s->text.n = 0;
    for (int32_t l = nd->head; l >= 0; l = AT(s->links, Link, l).next) {
        Node *d = N(s, AT(s->links, Link, l).node);
        if (d->tag != T_STR)
            return IRREGULAR;
        if (l != nd->head)
            TRY(text_add(s, ",", 1));
        if (s->text.n + AT(s->slen, int32_t, d->v) > s->max_string)
            return IRREGULAR;
        TRY(text_add(s, AT(s->sptr, const char *, d->v), AT(s->slen, int32_t, d->v)));
    }
    TRY(text_intern(s, out));
    s->node_dt[node] = *out;
    return OK;
}

/* A string field: str as is, None as "" (Python's _as_str); else irregular. */
static int read_str(Scan *s, int32_t node, int32_t *out) {
    Node *nd = N(s, node);
    if (nd->tag == T_STR)
        *out = (int32_t)nd->v;
    else if (nd->tag == T_NONE)
        *out = K_EMPTY;
    else
        return IRREGULAR;
    return OK;
}

/* An integer column value: None -> 0 (unless none_ok is 0), bools as 0/1. */
static int read_int(Scan *s, int32_t node, int none_ok, int64_t *out) {
    Node *nd = N(s, node);
    if (nd->tag == T_INT || nd->tag == T_BOOL)
        *out = nd->v;
    else if (nd->tag == T_NONE && none_ok)
        *out = 0;
    else
        return IRREGULAR;
    return OK;
}

/* A numeric string in an integer field, as PyTorch's analyzer tests write sequence
 * ids (str(collective_seq_id)): optional blanks, an optional sign, 1 to 18
 * digits, optional blanks -- the Python reader's lenient_ints pattern. Sets
 * *out and returns 1; 0 for anything else (left to the Python reader). */
static int numeric_string(Scan *s, Node *nd, int64_t *out) {
    if (nd->tag != T_STR)
        return 0;
    const char *p = AT(s->sptr, const char *, nd->v);
    int32_t n = AT(s->slen, int32_t, nd->v), i = 0, digits = 0;
    int64_t v = 0, sign = 1;
    while (i < n && (p[i] == ' ' || (p[i] >= '\t' && p[i] <= '\r')))
        i++;
    if (i < n && (p[i] == '+' || p[i] == '-'))
        sign = p[i++] == '-' ? -1 : 1;
    while (i < n && p[i] >= '0' && p[i] <= '9' && digits < 19) {
        v = v * 10 + (p[i++] - '0');
        digits++;
    }
    while (i < n && (p[i] == ' ' || (p[i] >= '\t' && p[i] <= '\r')))
        i++;
    if (digits == 0 || digits > 18 || i != n)
        return 0;
    *out = sign * v;
    return 1;
}

static int read_frame(Scan *s, int32_t node, int32_t *fid) {
    if (s->node_fid[node] >= 0) {
        *fid = s->node_fid[node];
        return OK;
    }
    Node *nd = N(s, node);
    if (nd->tag != T_DICT)
        return IRREGULAR;
    int32_t file = K_EMPTY, name = K_EMPTY;
    int64_t line = 0;
    for (int32_t l = nd->head; l >= 0; l = AT(s->links, Link, AT(s->links, Link, l).next).next) {
        Node *key = N(s, AT(s->links, Link, l).node);
        int32_t value = AT(s->links, Link, AT(s->links, Link, l).next).node;
        if (key->tag != T_STR)
            return IRREGULAR;
        if (key->v == K_FILENAME)
            TRY(read_str(s, value, &file));
        else if (key->v == K_NAME)
            TRY(read_str(s, value, &name));
        else if (key->v == K_LINE)
            TRY(read_int(s, value, 1, &line));
    }
    uint64_t h = hash_bytes(&file, sizeof file, HASH_SEED);
    h = hash_bytes(&name, sizeof name, h);
    h = hash_bytes(&line, sizeof line, h);
    uint64_t i = h & s->ftab.mask;
    for (int probes = 0;; probes++) {
        if (probes == MAX_PROBES)
            return IRREGULAR;
        int32_t id = s->ftab.slot[i];
        if (id < 0)
            break;
        if (AT(s->f_file, int32_t, id) == file && AT(s->f_name, int32_t, id) == name
            && AT(s->f_line, int64_t, id) == line) {
            *fid = s->node_fid[node] = id;
            return OK;
        }
        i = (i + 1) & s->ftab.mask;
    }
    int32_t id = (int32_t)s->f_file.n;
    TRY(vec_reserve(&s->f_file, 1));
    TRY(vec_reserve(&s->f_name, 1));
    TRY(vec_reserve(&s->f_line, 1));
    TRY(vec_reserve(&s->f_hash, 1));
    AT(s->f_file, int32_t, s->f_file.n++) = file;
    AT(s->f_name, int32_t, s->f_name.n++) = name;
    AT(s->f_line, int64_t, s->f_line.n++) = line;
    AT(s->f_hash, uint64_t, s->f_hash.n++) = h;
    s->ftab.slot[i] = id;
    s->ftab.count++;
    TRY(idtab_grow(&s->ftab, (const uint64_t *)s->f_hash.p));
    *fid = s->node_fid[node] = id;
    return OK;
}

/* The stack id of an entry's frames (-1: none). */
static int read_stack(Scan *s, int32_t node, int32_t *out) {
    if (node < 0) {
        *out = -1;
        return OK;
    }
    if (s->node_stid[node] >= -1) {
        *out = s->node_stid[node];
        return OK;
    }
    Node *nd = N(s, node);
    if (nd->tag == T_NONE || ((nd->tag == T_LIST || nd->tag == T_TUPLE) && nd->count == 0)) {
        *out = s->node_stid[node] = -1;
        return OK;
    }
    if (nd->tag != T_LIST && nd->tag != T_TUPLE)
        return IRREGULAR;
    s->fids.n = 0;
    TRY(vec_reserve(&s->fids, nd->count));
    for (int32_t l = nd->head; l >= 0; l = AT(s->links, Link, l).next) {
        int32_t fid;
        TRY(read_frame(s, AT(s->links, Link, l).node, &fid));
        AT(s->fids, int32_t, s->fids.n++) = fid;
    }
    const int32_t *fids = (const int32_t *)s->fids.p;
    Py_ssize_t k = s->fids.n;
    uint64_t h = hash_bytes(fids, k * (Py_ssize_t)sizeof(int32_t), HASH_SEED);
    uint64_t i = h & s->sttab.mask;
    for (int probes = 0;; probes++) {
        if (probes == MAX_PROBES)
            return IRREGULAR;
        int32_t id = s->sttab.slot[i];
        if (id < 0)
            break;
        int32_t lo = AT(s->st_off, int32_t, id), hi = AT(s->st_off, int32_t, id + 1);
        if (AT(s->st_hash, uint64_t, id) == h && hi - lo == k
            && memcmp(&AT(s->st_flat, int32_t, lo), fids, (size_t)k * sizeof(int32_t)) == 0) {
            *out = s->node_stid[node] = id;
            return OK;
        }
        i = (i + 1) & s->sttab.mask;
    }
    if (s->st_flat.n + k > INT32_MAX)
        return IRREGULAR;
    int32_t id = (int32_t)s->st_hash.n;
    TRY(vec_reserve(&s->st_flat, k));
    memcpy(&AT(s->st_flat, int32_t, s->st_flat.n), fids, (size_t)k * sizeof(int32_t));
    s->st_flat.n += k;
    TRY(vec_reserve(&s->st_off, 1));
    AT(s->st_off, int32_t, s->st_off.n++) = (int32_t)s->st_flat.n;
    TRY(vec_reserve(&s->st_hash, 1));
    AT(s->st_hash, uint64_t, s->st_hash.n++) = h;
    s->sttab.slot[i] = id;
    s->sttab.count++;
    TRY(idtab_grow(&s->sttab, (const uint64_t *)s->st_hash.p));
    *out = s->node_stid[node] = id;
    return OK;
}

/* ---- Python objects for the rest of the document ------------------------- */

static PyObject *to_py_once(Scan *s, int32_t id, int depth, int *rc);

/* One Python object per node, as the unpickler builds one per memoized object:
 * a list referenced a thousand times is built once, never copied. */
static PyObject *to_py(Scan *s, int32_t id, int depth, int *rc) {
    if (s->node_py[id] != NULL) {
        Py_INCREF(s->node_py[id]);
        return s->node_py[id];
    }
    PyObject *out = to_py_once(s, id, depth, rc);
    if (out != NULL) {
        Py_INCREF(out);
        s->node_py[id] = out;
    }
    return out;
}

static PyObject *to_py_once(Scan *s, int32_t id, int depth, int *rc) {
    if (depth > MAX_DEPTH) {
        *rc = IRREGULAR;
        return NULL;
    }
    Node *nd = N(s, id);
    PyObject *out = NULL;
    switch (nd->tag) {
    case T_NONE:
        Py_RETURN_NONE;
    case T_BOOL:
        return PyBool_FromLong((long)nd->v);
    case T_INT:
        out = PyLong_FromLongLong(nd->v);
        break;
    case T_FLOAT: {
        double d;
        memcpy(&d, &nd->v, sizeof d);
        out = PyFloat_FromDouble(d);
        break;
    }
    case T_STR:
        out = PyList_GET_ITEM(s->pystrings, nd->v);
        Py_INCREF(out);
        return out;
    case T_LIST:
    case T_TUPLE: {
        out = nd->tag == T_LIST ? PyList_New(nd->count) : PyTuple_New(nd->count);
        if (out == NULL)
            break;
        Py_ssize_t k = 0;
        for (int32_t l = nd->head; l >= 0; l = AT(s->links, Link, l).next, k++) {
            PyObject *item = to_py(s, AT(s->links, Link, l).node, depth + 1, rc);
            if (item == NULL) {
                Py_DECREF(out);
                return NULL;
            }
            if (nd->tag == T_LIST)
                PyList_SET_ITEM(out, k, item);
            else
                PyTuple_SET_ITEM(out, k, item);
        }
        return out;
    }
    case T_DICT: {
        out = PyDict_New();
        if (out == NULL)
            break;
        for (int32_t l = nd->head; l >= 0; l = AT(s->links, Link, AT(s->links, Link, l).next).next) {
            PyObject *k = to_py(s, AT(s->links, Link, l).node, depth + 1, rc);
            PyObject *v = k ? to_py(s, AT(s->links, Link, AT(s->links, Link, l).next).node,
                                    depth + 1, rc) : NULL;
            int bad = v == NULL || PyDict_SetItem(out, k, v) < 0;
            Py_XDECREF(k);
            Py_XDECREF(v);
            if (bad) {
                if (*rc == OK && PyErr_ExceptionMatches(PyExc_TypeError)) {
                    PyErr_Clear(); /* an unhashable key: the Python reader says so */
                    *rc = IRREGULAR;
                } else if (*rc == OK) {
                    *rc = ERR;
                }
                Py_DECREF(out);
                return NULL;
            }
        }
        return out;
    }
    default: /* big ints: the Python reader */
        *rc = IRREGULAR;
        return NULL;
    }
    if (out == NULL && *rc == OK)
        *rc = ERR;
    return out;
}

/* ---- the result ----------------------------------------------------------- */

enum { C_PG_NAME, C_PG_DESC, C_PNAME, C_STATE, C_IN_DT, C_OUT_DT, C_THREAD, C_IN_TXT,
       C_OUT_TXT, C_STACK, N_I32 };
static const char *const I32_NAMES[N_I32] = {
    "pg_name", "pg_desc", "profiling_name", "state", "in_dtypes", "out_dtypes", "thread",
    "in_sizes", "out_sizes", "stack"};
enum { C_IN_NUMEL, C_OUT_NUMEL, C_RECORD_ID, C_SEQ, C_P2P_SEQ, C_T_ENQ, C_T_START, C_T_DONE,
       C_TIMEOUT, C_DURATION, N_I64 };
static const char *const I64_NAMES[N_I64] = {
    "in_numel", "out_numel", "record_id", "seq", "p2p_seq", "t_enqueue", "t_start",
    "t_complete", "timeout_ms", "duration"};
/* entry keys holding plain integer columns, in I64 column order from C_RECORD_ID */
static const int INT_KEYS[] = {K_RECORD_ID, K_COLLECTIVE_SEQ_ID, K_P2P_SEQ_ID, K_TIME_CREATED,
                               K_TIME_STARTED, K_TIME_COMPLETED, K_TIMEOUT_MS};

/* duration_ms (optional, a float of ms) in ns, as the Python reader's _durations:
 * floor(ms * 1e6 + 0.5) in double precision for a number in [0, 2**62 / 1e6) ms;
 * -1 (unknown) for anything else: absent, None, bool, str, NaN, negative, huge. */
#define MAX_DURATION_MS (4611686018427387904.0 / 1e6)

static int64_t read_duration(Scan *s, int32_t node) {
    if (node < 0)
        return -1;
    Node *nd = N(s, node);
    double ms;
    if (nd->tag == T_FLOAT)
        memcpy(&ms, &nd->v, sizeof ms);
    else if (nd->tag == T_INT)
        ms = (double)nd->v;
    else
        return -1;
    if (!(ms >= 0.0 && ms < MAX_DURATION_MS))
        return -1;
    volatile double scaled = ms * 1e6; /* rounded to double here, never fused */
    volatile double half_up = scaled + 0.5;
    return (int64_t)floor(half_up);
}

static int set_array(PyObject *dict, const char *name, const void *p, Py_ssize_t bytes) {
    PyObject *arr = PyByteArray_FromStringAndSize(p, bytes);
    if (arr == NULL)
        return ERR;
    int rc = PyDict_SetItemString(dict, name, arr);
    Py_DECREF(arr);
    return rc < 0 ? ERR : OK;
}

static const int32_t NO_FIELDS[N_ENTRY_KEYS] = {
    -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
};
_Static_assert(N_ENTRY_KEYS == 19, "NO_FIELDS lists one -1 per entry key");

static int read_entries(Scan *s, int32_t entries, PyObject *result) {
    Node *list = N(s, entries);
    if (list->tag != T_LIST)
        return IRREGULAR;
    Py_ssize_t n = list->count;
    if (n > s->max_entries) {
        snprintf(s->why, sizeof s->why, "%zd entries (limit %zd per rank)", n, s->max_entries);
        return TOO_MANY;
    }
    int32_t *i32[N_I32];
    int64_t *i64[N_I64];
    uint8_t *is_p2p = NULL, *retired = NULL;
    long string_ints = 0;
    int rc = OK;
    memset(i32, 0, sizeof i32);
    memset(i64, 0, sizeof i64);
    for (int c = 0; c < N_I32 && rc == OK; c++)
        if ((i32[c] = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int32_t))) == NULL)
            rc = ERR;
    for (int c = 0; c < N_I64 && rc == OK; c++)
        if ((i64[c] = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t))) == NULL)
            rc = ERR;
    if (rc == OK && ((is_p2p = PyMem_Malloc((size_t)(n ? n : 1))) == NULL
                     || (retired = PyMem_Malloc((size_t)(n ? n : 1))) == NULL))
        rc = ERR;
    if (rc == ERR) {
        PyErr_NoMemory();
        goto done;
    }
    double in_sum = 0.0, out_sum = 0.0;
    Py_ssize_t i = 0;
    for (int32_t l = list->head; l >= 0 && rc == OK; l = AT(s->links, Link, l).next, i++) {
        Node *e = N(s, AT(s->links, Link, l).node);
        int32_t f[N_ENTRY_KEYS];
        memcpy(f, NO_FIELDS, sizeof f); /* all -1: a copy, not a `rep stos` per entry */
        if (e->tag != T_DICT || e->count > 2 * MAX_ENTRY_KEYS) {
            rc = IRREGULAR; /* not a record, or one with hundreds of keys */
            break;
        }
        for (int32_t m = e->head; m >= 0; m = AT(s->links, Link, AT(s->links, Link, m).next).next) {
            Node *key = N(s, AT(s->links, Link, m).node);
            if (key->tag != T_STR) {
                rc = IRREGULAR;
                break;
            }
            if (key->v < N_ENTRY_KEYS)
                f[key->v] = AT(s->links, Link, AT(s->links, Link, m).next).node;
        }
        for (int k = 0; k < N_REQUIRED && rc == OK; k++)
            if (f[k] < 0)
                rc = IRREGULAR; /* a field missing: the entry-at-a-time reader */
        if (rc != OK)
            break;
        /* process_group: (name, desc), a non-empty list or tuple */
        Node *pg = N(s, f[K_PROCESS_GROUP]);
        if ((pg->tag != T_TUPLE && pg->tag != T_LIST) || pg->count == 0) {
            rc = IRREGULAR;
            break;
        }
        if ((rc = read_str(s, AT(s->links, Link, pg->head).node, &i32[C_PG_NAME][i])) != OK)
            break;
        i32[C_PG_DESC][i] = K_EMPTY;
        if (pg->count > 1) {
            int32_t second = AT(s->links, Link, AT(s->links, Link, pg->head).next).node;
            if ((rc = read_str(s, second, &i32[C_PG_DESC][i])) != OK)
                break;
        }
        if ((rc = read_str(s, f[K_PROFILING_NAME], &i32[C_PNAME][i])) != OK
            || (rc = read_str(s, f[K_STATE], &i32[C_STATE][i])) != OK)
            break;
        Node *p2p = N(s, f[K_IS_P2P]);
        if (p2p->tag != T_BOOL && p2p->tag != T_INT && p2p->tag != T_NONE) {
            rc = IRREGULAR;
            break;
        }
        is_p2p[i] = p2p->v != 0 && p2p->tag != T_NONE;
        Node *ret = N(s, f[K_RETIRED]);
        retired[i] = ret->tag == T_BOOL && ret->v;
        if ((rc = read_sizes(s, f[K_INPUT_SIZES], &i64[C_IN_NUMEL][i], &in_sum,
                             &i32[C_IN_TXT][i])) != OK
            || (rc = read_sizes(s, f[K_OUTPUT_SIZES], &i64[C_OUT_NUMEL][i], &out_sum,
                                &i32[C_OUT_TXT][i])) != OK
            || (rc = read_dtypes(s, f[K_INPUT_DTYPES], 0, &i32[C_IN_DT][i])) != OK)
            break;
        if (f[K_OUTPUT_DTYPES] < 0)
            i32[C_OUT_DT][i] = K_EMPTY;
        else if ((rc = read_dtypes(s, f[K_OUTPUT_DTYPES], 1, &i32[C_OUT_DT][i])) != OK)
            break;
        if (f[K_THREAD_NAME] < 0)
            i32[C_THREAD][i] = K_EMPTY;
        else if ((rc = read_str(s, f[K_THREAD_NAME], &i32[C_THREAD][i])) != OK)
            break;
        for (int k = 0; k < (int)(sizeof INT_KEYS / sizeof INT_KEYS[0]) && rc == OK; k++) {
            rc = read_int(s, f[INT_KEYS[k]], INT_KEYS[k] != K_COLLECTIVE_SEQ_ID,
                          &i64[C_RECORD_ID + k][i]);
            if (rc == IRREGULAR
                && numeric_string(s, N(s, f[INT_KEYS[k]]), &i64[C_RECORD_ID + k][i])) {
                string_ints |= 1L << k; /* the caller notes the field */
                rc = OK;
            }
        }
        if (rc != OK)
            break;
        i64[C_DURATION][i] = read_duration(s, f[K_DURATION]);
        rc = read_stack(s, f[K_FRAMES], &i32[C_STACK][i]);
    }
    if (rc != OK)
        goto done;
    for (int c = 0; c < N_I32 && rc == OK; c++)
        rc = set_array(result, I32_NAMES[c], i32[c], n * (Py_ssize_t)sizeof(int32_t));
    for (int c = 0; c < N_I64 && rc == OK; c++)
        rc = set_array(result, I64_NAMES[c], i64[c], n * (Py_ssize_t)sizeof(int64_t));
    if (rc == OK)
        rc = set_array(result, "is_p2p", is_p2p, n);
    if (rc == OK)
        rc = set_array(result, "retired", retired, n);
    if (rc == OK) {
        PyObject *count = PyLong_FromSsize_t(n);
        rc = count == NULL || PyDict_SetItemString(result, "n", count) < 0 ? ERR : OK;
        Py_XDECREF(count);
    }
    if (rc == OK) {
        /* bit k: the integer column C_RECORD_ID + k held numeric strings */
        PyObject *mask = PyLong_FromLong(string_ints);
        rc = mask == NULL || PyDict_SetItemString(result, "string_ints", mask) < 0 ? ERR : OK;
        Py_XDECREF(mask);
    }
done:
    for (int c = 0; c < N_I32; c++)
        PyMem_Free(i32[c]);
    for (int c = 0; c < N_I64; c++)
        PyMem_Free(i64[c]);
    PyMem_Free(is_p2p);
    PyMem_Free(retired);
    return rc;
}

/* The node arena, links, stack and memo are kept between calls (up to
 * KEEP_BYTES each): fresh pages for them cost more than the scan itself. Safe
 * because scan() holds the GIL throughout and never calls back into Python code
 * that could re-enter it. */
#define KEEP_BYTES ((Py_ssize_t)64 << 20)
static Vec kept_nodes, kept_links, kept_stack, kept_memo;

static int vec_take(Vec *v, Vec *kept, Py_ssize_t size, Py_ssize_t cap) {
    if (kept->p != NULL) {
        *v = *kept;
        kept->p = NULL;
        v->n = 0;
        return OK;
    }
    return vec_init(v, size, cap);
}

static void vec_keep(Vec *v, Vec *kept) {
#ifdef Py_GIL_DISABLED
    return; /* free-threaded build: two scans may run at once */
#endif
    if (v->p != NULL && v->cap * v->size <= KEEP_BYTES && kept->p == NULL) {
        *kept = *v;
        v->p = NULL;
    }
}

static int scan_into(Scan *s, PyObject *result) {
    TRY(vec_take(&s->nodes, &kept_nodes, sizeof(Node), 1 << 16));
    TRY(vec_take(&s->links, &kept_links, sizeof(Link), 1 << 16));
    TRY(vec_take(&s->stack, &kept_stack, sizeof(int32_t), 64));
    TRY(vec_init(&s->marks, sizeof(Py_ssize_t), 16));
    TRY(vec_take(&s->memo, &kept_memo, sizeof(int32_t), 256));
    TRY(vec_init(&s->sptr, sizeof(const char *), 256));
    TRY(vec_init(&s->slen, sizeof(int32_t), 256));
    TRY(vec_init(&s->shash, sizeof(uint64_t), 256));
    TRY(idtab_init(&s->stab, 512));
    TRY(vec_init(&s->f_file, sizeof(int32_t), 64));
    TRY(vec_init(&s->f_name, sizeof(int32_t), 64));
    TRY(vec_init(&s->f_line, sizeof(int64_t), 64));
    TRY(vec_init(&s->f_hash, sizeof(uint64_t), 64));
    TRY(idtab_init(&s->ftab, 128));
    TRY(vec_init(&s->st_off, sizeof(int32_t), 64));
    TRY(vec_init(&s->st_flat, sizeof(int32_t), 256));
    TRY(vec_init(&s->st_hash, sizeof(uint64_t), 64));
    TRY(idtab_init(&s->sttab, 128));
    TRY(vec_init(&s->text, 1, 256));
    TRY(vec_init(&s->sz_numel, sizeof(int64_t), 64));
    TRY(vec_init(&s->sz_fsum, sizeof(double), 64));
    TRY(vec_init(&s->sz_text, sizeof(int32_t), 64));
    TRY(vec_init(&s->fids, sizeof(int32_t), 64));
    AT(s->st_off, int32_t, s->st_off.n++) = 0;
    if ((s->pystrings = PyList_New(0)) == NULL)
        return ERR;
    for (int k = 0; k < N_KEYS; k++) {
        int32_t id;
        TRY(intern(s, KEY_NAMES[k], (Py_ssize_t)strlen(KEY_NAMES[k]), 1, &id));
    }

    int32_t root;
    TRY(run(s, &root));
    Node *top = N(s, root);
    if (top->tag != T_DICT)
        return IRREGULAR;

    Py_ssize_t nn = s->nodes.n;
    s->node_fid = PyMem_Malloc((size_t)nn * sizeof(int32_t));
    s->node_stid = PyMem_Malloc((size_t)nn * sizeof(int32_t));
    s->node_sz = PyMem_Malloc((size_t)nn * sizeof(int32_t));
    s->node_dt = PyMem_Malloc((size_t)nn * sizeof(int32_t));
    s->node_py = PyMem_Calloc((size_t)nn, sizeof(PyObject *));
    if (s->node_fid == NULL || s->node_stid == NULL || s->node_sz == NULL || s->node_dt == NULL
        || s->node_py == NULL) {
        PyErr_NoMemory();
        return ERR;
    }
    s->n_py = nn;
    for (Py_ssize_t k = 0; k < nn; k++) {
        s->node_fid[k] = -1;
        s->node_stid[k] = -2;
        s->node_sz[k] = -1;
        s->node_dt[k] = -1;
    }

    /* the top level: "entries" into columns, the rest into Python objects */
    PyObject *doc = PyDict_New();
    if (doc == NULL)
        return ERR;
    int rc = PyDict_SetItemString(result, "doc", doc) < 0 ? ERR : OK;
    Py_DECREF(doc);
    if (rc != OK)
        return rc;
    int32_t entries = -1;
    for (int32_t l = top->head; l >= 0; l = AT(s->links, Link, AT(s->links, Link, l).next).next) {
        int32_t key = AT(s->links, Link, l).node;
        int32_t value = AT(s->links, Link, AT(s->links, Link, l).next).node;
        if (N(s, key)->tag == T_STR && N(s, key)->v == K_ENTRIES) {
            entries = value; /* the last one wins, as in a dict */
            continue;
        }
        PyObject *k = to_py(s, key, 1, &rc);
        PyObject *v = k ? to_py(s, value, 1, &rc) : NULL;
        int bad = v == NULL || PyDict_SetItem(doc, k, v) < 0;
        Py_XDECREF(k);
        Py_XDECREF(v);
        if (bad) {
            if (rc == OK && PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                rc = IRREGULAR;
            }
            return rc == OK ? ERR : rc;
        }
    }
    if (entries < 0)
        return IRREGULAR;
    TRY(read_entries(s, entries, result));

    if (PyDict_SetItemString(result, "strings", s->pystrings) < 0)
        return ERR;
    TRY(set_array(result, "frame_file", s->f_file.p, s->f_file.n * (Py_ssize_t)sizeof(int32_t)));
    TRY(set_array(result, "frame_name", s->f_name.p, s->f_name.n * (Py_ssize_t)sizeof(int32_t)));
    TRY(set_array(result, "frame_line", s->f_line.p, s->f_line.n * (Py_ssize_t)sizeof(int64_t)));
    TRY(set_array(result, "stack_offsets", s->st_off.p, s->st_off.n * (Py_ssize_t)sizeof(int32_t)));
    TRY(set_array(result, "stack_frames", s->st_flat.p, s->st_flat.n * (Py_ssize_t)sizeof(int32_t)));
    return OK;
}

static void scan_free(Scan *s) {
    vec_keep(&s->nodes, &kept_nodes);
    vec_keep(&s->links, &kept_links);
    vec_keep(&s->stack, &kept_stack);
    vec_keep(&s->memo, &kept_memo);
    Vec *vecs[] = {&s->nodes, &s->links, &s->stack, &s->marks, &s->memo, &s->sptr, &s->slen,
                   &s->shash, &s->f_file, &s->f_name, &s->f_line, &s->f_hash, &s->st_off,
                   &s->st_flat, &s->st_hash, &s->text, &s->fids, &s->sz_numel, &s->sz_fsum,
                   &s->sz_text};
    for (size_t k = 0; k < sizeof vecs / sizeof vecs[0]; k++)
        vec_free(vecs[k]);
    PyMem_Free(s->stab.slot);
    PyMem_Free(s->ftab.slot);
    PyMem_Free(s->sttab.slot);
    PyMem_Free(s->node_fid);
    PyMem_Free(s->node_stid);
    PyMem_Free(s->node_sz);
    PyMem_Free(s->node_dt);
    if (s->node_py != NULL) {
        for (Py_ssize_t k = 0; k < s->n_py; k++)
            Py_XDECREF(s->node_py[k]);
        PyMem_Free(s->node_py);
    }
    while (s->arena) {
        ArenaChunk *next = s->arena->next;
        PyMem_Free(s->arena);
        s->arena = next;
    }
    Py_XDECREF(s->pystrings);
}

static PyObject *scan(PyObject *Py_UNUSED(module), PyObject *args) {
    Py_buffer view;
    Py_ssize_t max_dims = 64, max_text_dims = 4096, max_string = 65536;
    Py_ssize_t max_entries = PY_SSIZE_T_MAX, max_built = PY_SSIZE_T_MAX;
    if (!PyArg_ParseTuple(args, "y*|nnnnn:scan", &view, &max_dims, &max_text_dims, &max_string,
                          &max_entries, &max_built))
        return NULL;
    if (view.len > MAX_SCAN_BYTES) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    Scan s;
    memset(&s, 0, sizeof s);
    s.data = view.buf;
    s.len = view.len;
    s.max_dims = max_dims;
    s.max_text_dims = max_text_dims;
    s.max_string = max_string;
    s.max_entries = max_entries;
    s.max_built = max_built < 0 ? 0 : max_built;
    PyObject *result = PyDict_New();
    int rc = result == NULL ? ERR : scan_into(&s, result);
    scan_free(&s);
    PyBuffer_Release(&view);
    if (rc == OK)
        return result;
    Py_XDECREF(result);
    if (rc == ERR)
        return NULL;
    if (rc == CORRUPT)
        return PyUnicode_FromString(s.why);
    if (rc == TOO_MANY) /* the caller's limit: a tuple, neither a document nor corrupt */
        return Py_BuildValue("(s)", s.why);
    Py_RETURN_NONE;
}

/* ---- the guard for the Python unpickler ------------------------------------ */

/* Bytes of argument of each opcode: >= 0 fixed, -1 one text line, -2 two text
 * lines, -4/-8/-101 a length prefix of 4, 8 or 1 bytes followed by that many
 * bytes; -100 unknown opcode. */
static int arg_kind(unsigned char op) {
    switch (op) {
    case '(': case '.': case '0': case '1': case '2': case 'N': case ')': case ']': case '}':
    case 'a': case 'e': case 'u': case 's': case 'l': case 't': case 'd': case 0x85:
    case 0x86: case 0x87: case 0x88: case 0x89: case 0x94: case 'R': case 'b': case 'o':
    case 0x81: case 0x92: case 0x93: case 'Q': case 0x8f: case 0x90: case 0x91: case 0x97:
    case 0x98:
        return 0;
    case 0x80: case 'K': case 'q': case 'h': case 0x82:
        return 1;
    case 'M': case 0x83:
        return 2;
    case 'J': case 'r': case 'j': case 0x84:
        return 4;
    case 'G': case 0x95:
        return 8;
    case 'I': case 'L': case 'F': case 'S': case 'V': case 'P': case 'p': case 'g':
        return -1;
    case 'c': case 'i':
        return -2;
    case 'X': case 'T': case 'B': case 0x8b:
        return -4;
    case 0x8d: case 0x8e: case 0x96:
        return -8;
    case 0x8c: case 'U': case 'C': case 0x8a:
        return -101;
    default:
        return -100;
    }
}

static PyObject *check(PyObject *Py_UNUSED(module), PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *data = view.buf, *p = data, *end = data + view.len;
    uint64_t limit = (uint64_t)view.len; /* writers number memo entries from 0 */
    const char *why = NULL;
    uint64_t memoized = 0;
    int stopped = 0;
    while (p < end && why == NULL) {
        unsigned char op = *p++;
        int kind = arg_kind(op);
        uint64_t n = 0, memo = UINT64_MAX;
        if (op == '.') {
            stopped = 1;
            break;
        }
        if (kind == -100) {
            why = "unknown opcode";
        } else if (kind >= 0) {
            if ((uint64_t)(end - p) < (uint64_t)kind) {
                why = "truncated";
                break;
            }
            if (op == 'q')
                memo = p[0];
            else if (op == 'r')
                memo = le(p, 4);
            p += kind;
        } else if (kind == -1 || kind == -2) {
            for (int line = 0; line < -kind && why == NULL; line++) {
                const unsigned char *nl = memchr(p, '\n', (size_t)(end - p));
                if (nl == NULL) {
                    why = "truncated";
                    break;
                }
                if (op == 'p') { /* PUT with a decimal index */
                    uint64_t v = 0;
                    for (const unsigned char *q = p; q < nl && v <= limit; q++)
                        v = (*q >= '0' && *q <= '9') ? v * 10 + (uint64_t)(*q - '0') : v;
                    memo = v;
                }
                p = nl + 1;
            }
        } else {
            int width = kind == -101 ? 1 : -kind;
            if ((uint64_t)(end - p) < (uint64_t)width) {
                why = "truncated";
                break;
            }
            n = le(p, width);
            if (op == 0x8b && (n & 0x80000000u))
                n = UINT64_MAX; /* a negative LONG4 length */
            p += width;
            if ((uint64_t)(end - p) < n) {
                why = "truncated (an argument runs past the end of the file)";
                break;
            }
            p += n;
        }
        if (memo != UINT64_MAX && memo > limit)
            why = "memo index past the size of the file";
        if (op == 0x94 && ++memoized > limit) /* MEMOIZE: cannot outnumber the bytes */
            why = "memo index past the size of the file";
    }
    if (why == NULL && !stopped)
        why = "truncated (no STOP opcode)";
    Py_ssize_t at = (Py_ssize_t)(p - data) - 1;
    PyBuffer_Release(&view);
    if (why == NULL)
        Py_RETURN_NONE;
    return PyUnicode_FromFormat("%s at byte %zd", why, at < 0 ? 0 : at);
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(data, max_dims=64, max_text_dims=4096, max_string=65536, max_entries=..., "
     "max_built=...) -> dict | str | tuple | None: a native pickle dump's entries as "
     "columns; a str says why the pickle is malformed; a 1-tuple, which limit it passes "
     "(entries, bytes of built text); None: read it with the Python unpickler."},
    {"check", check, METH_O,
     "check(data) -> str | None: walk every opcode without running any; a str says why "
     "the Python unpickler must not be given this pickle (truncated, unknown opcode, a memo "
     "index past the size of the file), None: it may."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "frforensics.formats._picklescan",
    "PyTorch's native pickle dumps read into columns without building the document.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__picklescan(void) { return PyModule_Create(&module); }
