/* dtwatch's native recording path: the wrapper of the single-tensor and no-tensor collectives, in C.
 *
 * Contract: the same as dtwatch/record/wrapper.py's Python wrapper (the one recording path), whose record
 * it writes byte for byte: one fixed-size record into the rank's ring before calling the original, the exit
 * stamped after. What is rare or complex stays in Python and is called from here: registering a group met
 * the first time, resolving a call site the first time (Recorder.sites.call_sites), the completion of
 * async calls (Recorder.track_async / finish), dtwatch's own failures (Recorder.fail). The record's layout
 * (field offsets and sizes) is given by dtwatch.ring.layout at configure(); nothing of it is counted here.
 *
 * Cost: the per-call work is the argument inspection, one lookup in a cache of call sites by (code object,
 * instruction offset), the group's sequence number (a call into torch), and two writes into the mapping.
 * No lock and no allocation beyond the few small objects the Python API hands back.
 *
 * Failure policy: never raises into the caller on its own account and never changes arguments or results;
 * a failure of its own is handed to Recorder.fail (one warning per process) and the call goes through
 * unrecorded. The mapping is taken as a buffer only for the moment of a write, so a ring being closed
 * (a new default group) raises here and is reported, never written after unmapping.
 *
 * Built with CPython's C API only: no torch headers, so one build serves every torch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
/* CPython 3.11's frame records (see "walking the calling thread's Python frames"). */
#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#endif
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* ---- the record's layout, from dtwatch.ring.layout (configure) ---------------------------------------- */
enum {
    F_STAMP, F_SEQ, F_T_ENTER, F_T_EXIT, F_SEQ_SPAN, F_STATUS, F_OP, F_DTYPE, F_NDIM, F_FLAGS, F_NTENSORS,
    F_GROUP, F_SITE, F_STEP, F_NUMEL, F_PEER, F_DIMS, F_USER_SITE, F_STAMP2, N_FIELDS
};
static const char *field_names[N_FIELDS] = {
    "stamp", "seq", "t_enter", "t_exit", "seq_span", "status", "op", "dtype", "ndim", "flags", "ntensors",
    "group", "site", "step", "numel", "peer", "dims", "user_site", "stamp2",
};
static const Py_ssize_t field_sizes[N_FIELDS] = {8, 8, 8, 8, 4, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 4, 32, 4, 8};
static Py_ssize_t off_of[N_FIELDS];
static Py_ssize_t record_size = 0; /* 0: not configured */
static PyObject *dtype_codes = NULL;  /* torch.dtype -> the ring's code */
static PyObject *last_dtype = NULL;   /* the dtype looked up last (a strong reference), and its code */
static int last_dtype_code = 0;
static long long numel_from_shape = -2;
static int flag_async = 1, flag_enqueued = 32;
static int status_ok = 1, status_error = 2;

#define MAX_RECORD 512

/* Interned attribute names. */
static PyObject *s_sites,
    *s_shape, *s_dtype, *s_numel, *s_register_group, *s_walk, *s_fail, *s_track_async, *s_enqueued,
    *s_group, *s_async_op;

/* A thread inside a native wrapper's original call (what torch's collective hooks check: the wrapper records
 * the call), and what makes a nested wrapped call pass through (a composite op's inner calls). */
#if defined(__GNUC__) && !defined(_WIN32)
/* initial-exec: one load, not a call into the dynamic linker per access (an int fits the static TLS surplus that
 * glibc keeps for modules loaded later; where it did not, the import fails and the Python path records). */
#define THREAD_LOCAL _Thread_local __attribute__((tls_model("initial-exec")))
#else
#define THREAD_LOCAL _Thread_local
#endif
static THREAD_LOCAL int depth = 0;

/* ---- what call-site resolution needs, cached: the same as dtwatch.record.callsite's caches ---------------
 * Three kinds of entries in one open-addressed table, keyed by (code object, instruction offset, tag):
 * KIND (offset -1): the code's INTERNAL / OTHER / LIBRARY / USER class; USER_POS: the site id of a position in user
 * code; OTHER_POS: the site id of a position in library or other code. A miss anywhere sends the call to Python
 * (SiteTable.walk), which registers what is missing and hands back what to cache here. */
#define CACHE_SLOTS 8192 /* a power of two; filled to at most three quarters, then misses go to Python */
enum { TAG_KIND = 1, TAG_USER_POS = 2, TAG_OTHER_POS = 3 };
enum { KIND_INTERNAL = 0, KIND_OTHER = 1, KIND_LIBRARY = 2, KIND_USER = 3 };
typedef struct {
    PyObject *code; /* a strong reference: the address is never reused for another code object */
    int lasti;
    int tag;
    uint32_t value;
} CacheEntry;
static CacheEntry cache[CACHE_SLOTS];
static int cache_used = 0;
static unsigned long long cache_generation = 0; /* the ring the cached site ids belong to (a new ring: new ids) */

static void cache_clear(unsigned long long generation) {
    for (int i = 0; i < CACHE_SLOTS; i++) {
        Py_CLEAR(cache[i].code);
    }
    cache_used = 0;
    cache_generation = generation;
}

static inline CacheEntry *cache_slot(PyObject *code, int lasti, int tag) {
    uintptr_t h = ((uintptr_t)code >> 4) * 0x9E3779B97F4A7C15ull;
    size_t i = (size_t)((h ^ ((uintptr_t)(unsigned)lasti * 0x85EBCA77u) ^ (uintptr_t)tag) & (CACHE_SLOTS - 1));
    for (;;) {
        CacheEntry *e = &cache[i];
        if (e->code == NULL || (e->code == code && e->lasti == lasti && e->tag == tag)) return e;
        i = (i + 1) & (CACHE_SLOTS - 1);
    }
}

static inline int cache_get(PyObject *code, int lasti, int tag, uint32_t *value) {
    CacheEntry *e = cache_slot(code, lasti, tag);
    if (e->code == NULL) return 0;
    *value = e->value;
    return 1;
}

static void cache_put(PyObject *code, int lasti, int tag, uint32_t value) {
    if (cache_used >= CACHE_SLOTS * 3 / 4) return;
    CacheEntry *e = cache_slot(code, lasti, tag);
    if (e->code != NULL) return;
    Py_INCREF(code);
    e->code = code;
    e->lasti = lasti;
    e->tag = tag;
    e->value = value;
    cache_used++;
}

/* ---- walking the calling thread's Python frames -----------------------------------------------------------
 * On CPython 3.11 the walk reads the interpreter's own frame records (no frame object is created: asking for
 * PyFrameObjects materialises one per frame, which was most of the cost of a call made through library frames);
 * elsewhere it uses the public frame API. Both give what Python's frame.f_lasti gives (a byte offset), the key
 * the cache shares with dtwatch.record.callsite. Frames not yet started (incomplete) are skipped, as
 * PyFrame_GetBack skips them. */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define FAST_FRAMES 1
typedef _PyInterpreterFrame *FrameRef;
static inline FrameRef frame_complete(FrameRef f) {
    while (f != NULL && _PyFrame_IsIncomplete(f)) f = f->previous;
    return f;
}
static inline FrameRef frame_first(void) { return frame_complete(PyThreadState_GET()->cframe->current_frame); }
static inline FrameRef frame_next(FrameRef f) { return frame_complete(f->previous); }
static inline PyObject *frame_code(FrameRef f) { return (PyObject *)f->f_code; } /* borrowed */
static inline int frame_lasti(FrameRef f) {
    int lasti = _PyInterpreterFrame_LASTI(f);
    return lasti < 0 ? -1 : lasti * (int)sizeof(_Py_CODEUNIT);
}
static inline void frame_release(FrameRef f) { (void)f; }
#else
typedef PyFrameObject *FrameRef; /* a strong reference */
static inline FrameRef frame_first(void) { return (FrameRef)Py_XNewRef(PyEval_GetFrame()); }
static inline FrameRef frame_next(FrameRef f) {
    FrameRef back = PyFrame_GetBack(f);
    Py_DECREF(f);
    return back;
}
static inline PyObject *frame_code(FrameRef f) { /* borrowed: the frame holds its code */
    PyCodeObject *code = PyFrame_GetCode(f);
    Py_DECREF(code);
    return (PyObject *)code;
}
static inline int frame_lasti(FrameRef f) { return PyFrame_GetLasti(f); }
static inline void frame_release(FrameRef f) { Py_XDECREF(f); }
#endif

/* (site, user site) of a call made in the calling thread's innermost Python frame, from the cache alone, as
 * SiteTable.frame_sites resolves them: the first frame outside torch and dtwatch, and the first user frame.
 * 1: resolved (also with no Python frame at all: 0, 0); 0: something is not cached. */
static int sites_from_cache(uint32_t *site_out, uint32_t *user_out) {
    uint32_t site = 0, value;
    FrameRef f = frame_first();
    if (f == NULL) {
        *site_out = *user_out = 0;
        return 1;
    }
    while (f != NULL) {
        PyObject *code = frame_code(f);
        if (!cache_get(code, -1, TAG_KIND, &value)) break;
        if (value == KIND_USER) {
            uint32_t user;
            if (!cache_get(code, frame_lasti(f), TAG_USER_POS, &user)) break;
            frame_release(f);
            *site_out = site ? site : user;
            *user_out = user;
            return 1;
        }
        if (value != KIND_INTERNAL && !site && !cache_get(code, frame_lasti(f), TAG_OTHER_POS, &site)) break;
        f = frame_next(f);
    }
    if (f == NULL) { /* no user frame on the stack: the site is the user's site too */
        *site_out = *user_out = site;
        return 1;
    }
    frame_release(f);
    return 0;
}

/* Ask Python (rec.sites.walk) to resolve and register what the cache lacked, cache it, and resolve again. */
static int sites_from_python(PyObject *rec, uint32_t *site_out, uint32_t *user_out) {
    PyFrameObject *frame = PyEval_GetFrame(); /* borrowed */
    if (frame == NULL) {
        *site_out = *user_out = 0;
        return 0;
    }
    PyObject *sites = PyObject_GetAttr(rec, s_sites);
    PyObject *walked = sites ? PyObject_CallMethodOneArg(sites, s_walk, (PyObject *)frame) : NULL;
    Py_XDECREF(sites);
    if (walked == NULL) return -1;
    PyObject *seq = PySequence_Fast(walked, "SiteTable.walk() gives a list");
    Py_DECREF(walked);
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *code;
        int lasti, kind;
        unsigned long site;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "Oiik", &code, &lasti, &kind, &site)) {
            Py_DECREF(seq);
            return -1;
        }
        cache_put(code, -1, TAG_KIND, (uint32_t)kind);
        if (site) cache_put(code, lasti, kind == KIND_USER ? TAG_USER_POS : TAG_OTHER_POS, (uint32_t)site);
    }
    Py_DECREF(seq);
    if (!sites_from_cache(site_out, user_out)) *site_out = *user_out = 0; /* a full table: unknown (0) */
    return 0;
}

/* ---- a tensor's shape and dtype ------------------------------------------------------------------------
 * Read through the getters torch's tensor type defines, found once per type (the last type seen) instead of by
 * the generic attribute lookup on every call. The type's version tag says when its attributes changed (a getter
 * replaced): then they are looked up again. A type whose attribute is not a C getter (a subclass that defines
 * `shape` in Python) goes through the generic lookup every time. */
typedef struct {
    PyTypeObject *type; /* a strong reference; NULL: nothing cached */
    unsigned int version;
    getter shape, dtype;  /* NULL: that attribute is read by the generic lookup */
    void *shape_closure, *dtype_closure;
} TensorGetters;
static TensorGetters tensor_getters = {NULL, 0, NULL, NULL, NULL, NULL};

static void getter_of(PyTypeObject *type, PyObject *name, getter *get, void **closure) {
    PyObject *descr = _PyType_Lookup(type, name); /* borrowed */
    *get = NULL;
    *closure = NULL;
    if (descr != NULL && Py_IS_TYPE(descr, &PyGetSetDescr_Type)) {
        PyGetSetDef *def = ((PyGetSetDescrObject *)descr)->d_getset;
        *get = def->get;
        *closure = def->closure;
    }
}

static inline TensorGetters *getters_for(PyTypeObject *type) {
    TensorGetters *g = &tensor_getters;
    if (g->type == type && PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG) && g->version == type->tp_version_tag)
        return g;
    Py_INCREF(type);
    Py_XSETREF(g->type, type);
    getter_of(type, s_shape, &g->shape, &g->shape_closure);
    getter_of(type, s_dtype, &g->dtype, &g->dtype_closure);
    /* _PyType_Lookup assigned a version tag where it could; without one, nothing is cached. */
    if (!PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)) g->shape = g->dtype = NULL;
    g->version = type->tp_version_tag;
    return g;
}

static inline PyObject *tensor_attr(PyObject *t, getter get, void *closure, PyObject *name) {
    return get != NULL ? get(t, closure) : PyObject_GetAttr(t, name);
}

/* ---- helpers ---------------------------------------------------------------------------------------- */
static inline double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* args[pos] if given positionally, else the keyword argument `name` (borrowed; NULL if absent). */
static inline PyObject *arg_at(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, Py_ssize_t pos,
                               PyObject *name) {
    if (pos >= 0 && pos < nargs) return args[pos];
    if (kwnames == NULL || name == NULL) return NULL;
    Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < nkw; i++) {
        if (PyTuple_GET_ITEM(kwnames, i) == name) return args[nargs + i];
    }
    for (Py_ssize_t i = 0; i < nkw; i++) {
        if (PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, i), name) == 0) return args[nargs + i];
    }
    return NULL;
}



#define PUT(buf, field, type, value)                                      \
    do {                                                                  \
        type v_ = (type)(value);                                          \
        memcpy((buf) + off_of[field], &v_, sizeof(type));                 \
    } while (0)

/* Hand dtwatch's own failure (the pending exception) to rec.fail(what, exc); never raises. */
static void report_failure(PyObject *rec, PyObject *what) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *r = PyObject_CallMethodObjArgs(rec, s_fail, what, value ? value : Py_None, NULL);
    if (r == NULL) PyErr_Clear();
    Py_XDECREF(r);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

/* ---- the recorder's ring, as the native wrappers see it ------------------------------------------------
 * One State per Recorder (Recorder.native): the mapping (held as a buffer while attached, so it is never written
 * after it is unmapped: closing it first needs detach()), where the records start, how many there are, the step,
 * the default group, and the stamp counter every writer of the rank's records takes from (the State is also
 * Recorder.stamps: next(state) in Python). `generation` changes at each attach: a call that began on another
 * ring does not stamp its exit into this one, and the call-site cache (ids are per ring) starts over. */
typedef struct {
    PyObject_HEAD
    PyObject *mm;        /* NULL while detached */
    Py_buffer view;
    Py_ssize_t records_off, capacity;
    unsigned long long next_stamp, step, generation;
    PyObject *default_pg;
} State;

static PyObject *state_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (!PyArg_ParseTuple(args, ":State")) return NULL;
    State *self = (State *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->next_stamp = 1;
    Py_INCREF(Py_None);
    self->default_pg = Py_None;
    return (PyObject *)self;
}

static void state_release(State *self) {
    if (self->mm != NULL) {
        PyBuffer_Release(&self->view);
        Py_CLEAR(self->mm);
    }
}

static void state_dealloc(State *self) {
    state_release(self);
    Py_CLEAR(self->default_pg);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* attach(mm, records_off, capacity): record into this mapping from now on. */
static PyObject *state_attach(State *self, PyObject *args) {
    PyObject *mm;
    Py_ssize_t records_off, capacity;
    if (!PyArg_ParseTuple(args, "Onn:attach", &mm, &records_off, &capacity)) return NULL;
    if (capacity <= 0 || records_off < 0) {
        PyErr_SetString(PyExc_ValueError, "a ring needs a capacity and a place for its records");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(mm, &view, PyBUF_WRITABLE) < 0) return NULL;
    if (records_off + capacity * record_size > view.len) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "the records do not fit the mapping");
        return NULL;
    }
    state_release(self);
    Py_INCREF(mm);
    self->mm = mm;
    self->view = view;
    self->records_off = records_off;
    self->capacity = capacity;
    self->generation++;
    Py_RETURN_NONE;
}

static PyObject *state_detach(State *self, PyObject *unused) {
    state_release(self);
    self->generation++;
    Py_RETURN_NONE;
}

static PyObject *state_peek(State *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(self->next_stamp);
}

static PyObject *state_iternext(State *self) {
    return PyLong_FromUnsignedLongLong(self->next_stamp++);
}

static PyObject *state_get_step(State *self, void *closure) {
    return PyLong_FromUnsignedLongLong(self->step);
}

static int state_set_step(State *self, PyObject *value, void *closure) {
    unsigned long long v = value ? PyLong_AsUnsignedLongLong(value) : 0;
    if (PyErr_Occurred()) return -1;
    self->step = v;
    return 0;
}

static PyObject *state_get_default_pg(State *self, void *closure) {
    return Py_NewRef(self->default_pg);
}

static int state_set_default_pg(State *self, PyObject *value, void *closure) {
    Py_XSETREF(self->default_pg, Py_NewRef(value ? value : Py_None));
    return 0;
}


static PyMethodDef state_methods[] = {
    {"attach", (PyCFunction)state_attach, METH_VARARGS, "attach(mm, records_off, capacity)"},
    {"detach", (PyCFunction)state_detach, METH_NOARGS, "Stop recording; the mapping may be closed after this."},
    {"peek", (PyCFunction)state_peek, METH_NOARGS, "The next stamp, not taken."},
    {NULL}
};

static PyGetSetDef state_getset[] = {
    {"step", (getter)state_get_step, (setter)state_set_step, "the training step records carry", NULL},
    {"default_pg", (getter)state_get_default_pg, (setter)state_set_default_pg, "the group of group=None", NULL},
    {NULL}
};

static PyTypeObject StateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dtwatch.record._fastpath.State",
    .tp_doc = "The ring the native wrappers record into, and the rank's stamp counter (an iterator).",
    .tp_basicsize = sizeof(State),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = state_new,
    .tp_dealloc = (destructor)state_dealloc,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)state_iternext,
    .tp_methods = state_methods,
    .tp_getset = state_getset,
};

/* ---- the wrapper ----------------------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    PyObject *original;
    PyObject *rec;
    State *state;
    PyObject *groups;       /* rec.groups: the same dict for the recorder's life (cleared in place) */
    PyObject *dict;         /* functools.wraps' attributes (__wrapped__, __name__, __doc__, ...) */
    PyObject *weaklist;
    PyObject *payload_name; /* NULL: no tensor argument (barrier) */
    PyObject *peer_name;
    PyObject *what;         /* "recording <op>" */
    PyObject *what_end;     /* "recording the end of <op>" */
    vectorcallfunc vectorcall;
    Py_ssize_t payload_pos, group_pos, async_pos, peer_pos;
    int op, flags, always_async, spans, is_p2p, tracked_sync;
} Recorded;

static PyObject *recorded_call_original(Recorded *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
}

static PyObject *recorded_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Recorded *self = (Recorded *)callable;
    PyObject *rec = self->rec;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);

    State *state = self->state;
    if (depth > 0 || state->mm == NULL) return recorded_call_original(self, args, nargsf, kwnames);
    unsigned long long generation = state->generation;
    Py_ssize_t off = -1;
    long long stamp = 0, seq0 = 0;
    int is_async = 0;
    PyObject *seqfn = NULL, *tracked = NULL, *enqueue_on = NULL; /* strong references */
    {
        char buf[MAX_RECORD];
        long long dims[4] = {0, 0, 0, 0};
        int ndim = 0, dt = 0;
        long long numel = 0, peer = -1;
        PyObject *group, *ginfo = NULL;

        group = arg_at(args, nargs, kwnames, self->group_pos, s_group);
        if (self->payload_name != NULL) {
            PyObject *t = arg_at(args, nargs, kwnames, self->payload_pos, self->payload_name);
            if (t == NULL) t = Py_None;
            TensorGetters *tg = getters_for(Py_TYPE(t));
            PyObject *shape = tensor_attr(t, tg->shape, tg->shape_closure, s_shape);
            if (shape == NULL) goto failed;
            /* torch.Size is a tuple subclass: read in place (PySequence_Fast would copy it into a new list). */
            PyObject *seq = PyTuple_Check(shape) ? Py_NewRef(shape) : PySequence_Tuple(shape);
            Py_DECREF(shape);
            if (seq == NULL) goto failed;
            Py_ssize_t n = PyTuple_GET_SIZE(seq);
            ndim = n > 255 ? 255 : (int)n;
            for (Py_ssize_t i = 0; i < n && i < 4; i++) {
                dims[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, i));
            }
            Py_DECREF(seq);
            if (PyErr_Occurred()) goto failed;
            tg = getters_for(Py_TYPE(t)); /* the shape's getter ran code: the cache may have moved on */
            PyObject *dtype = tensor_attr(t, tg->dtype, tg->dtype_closure, s_dtype);
            if (dtype == NULL) goto failed;
            if (dtype == last_dtype) { /* a job's tensors share a few dtypes: the last one's code, without hashing */
                dt = last_dtype_code;
                Py_DECREF(dtype);
            } else {
                PyObject *code = PyDict_GetItemWithError(dtype_codes, dtype);
                if (code == NULL && PyErr_Occurred()) {
                    Py_DECREF(dtype);
                    goto failed;
                }
                dt = code ? (int)PyLong_AsLong(code) : 0;
                last_dtype_code = dt;
                Py_XSETREF(last_dtype, dtype); /* holds it: its address is never another object's */
            }
            if (n <= 4) {
                numel = numel_from_shape; /* the reader derives it from the dims */
            } else {
                PyObject *v = PyObject_CallMethodNoArgs(t, s_numel);
                if (v == NULL) goto failed;
                numel = PyLong_AsLongLong(v);
                Py_DECREF(v);
                if (PyErr_Occurred()) goto failed;
            }
        }
        if (self->peer_pos >= 0 || self->peer_name != NULL) {
            PyObject *p = arg_at(args, nargs, kwnames, self->peer_pos, self->peer_name);
            if (p != NULL && p != Py_None) {
                peer = PyLong_AsLongLong(p);
                if (PyErr_Occurred()) goto failed;
            }
        }
        if (group == NULL || group == Py_None) {
            group = Py_NewRef(state->default_pg);
        } else {
            Py_INCREF(group);
        }
        {
            ginfo = PyDict_GetItemWithError(self->groups, group);
            Py_XINCREF(ginfo);
            if (ginfo == NULL) {
                if (PyErr_Occurred()) {
                    Py_DECREF(group);
                    goto failed;
                }
                ginfo = PyObject_CallMethodOneArg(rec, s_register_group, group);
            }
            Py_DECREF(group);
            if (ginfo == NULL) goto failed;
        }
        if (!PyTuple_Check(ginfo) || PyTuple_GET_SIZE(ginfo) != 3) {
            Py_DECREF(ginfo);
            PyErr_SetString(PyExc_TypeError, "a group entry is not (slot, sequence reader, tracked)");
            goto failed;
        }
        long slot = PyLong_AsLong(PyTuple_GET_ITEM(ginfo, 0));
        seqfn = PyTuple_GET_ITEM(ginfo, 1);
        tracked = PyTuple_GET_ITEM(ginfo, 2);
        if (seqfn == Py_None) seqfn = NULL;
        if (tracked == Py_None) tracked = NULL;
        Py_XINCREF(seqfn);
        Py_XINCREF(tracked);
        Py_DECREF(ginfo);
        if (slot == -1 && PyErr_Occurred()) goto failed;
        if (seqfn != NULL) {
            PyObject *v = PyObject_CallNoArgs(seqfn);
            if (v == NULL) goto failed;
            seq0 = PyLong_AsLongLong(v);
            Py_DECREF(v);
            if (PyErr_Occurred()) goto failed;
        }
        if (self->always_async) {
            is_async = 1;
        } else if (self->async_pos >= 0) {
            PyObject *a = arg_at(args, nargs, kwnames, self->async_pos, s_async_op);
            if (a != NULL) {
                is_async = PyObject_IsTrue(a);
                if (is_async < 0) goto failed;
            }
        }
        /* On a tracked group (NCCL) a synchronous collective returns before it completes: its record stays in
         * flight until the group's completions pass it (dtwatch.record.completion). */
        if (self->tracked_sync && !is_async && tracked != NULL) {
            enqueue_on = tracked;
            Py_INCREF(enqueue_on);
        }

        /* The call site: the calling frame (a C callable runs in its caller's frame), from the cache. */
        uint32_t site = 0, user_site = 0;
        {
            if (cache_generation != generation) cache_clear(generation);
            if (!sites_from_cache(&site, &user_site) && sites_from_python(rec, &site, &user_site) < 0) goto failed;
        }

        /* The stamp and the slot: from here on nothing calls Python (nothing else records in between), and the
         * ring is the one the call began on (Python ran above: a new default group may have replaced it). */
        if (state->mm == NULL || state->generation != generation) goto unrecorded;
        stamp = (long long)state->next_stamp++;
        off = (Py_ssize_t)(state->records_off + ((stamp - 1) % state->capacity) * record_size);
        int flags = self->flags | (is_async ? flag_async : enqueue_on ? flag_enqueued : 0);
        memset(buf, 0, (size_t)record_size);
        PUT(buf, F_STAMP, uint64_t, stamp);
        PUT(buf, F_SEQ, uint64_t, seq0 + 1);
        PUT(buf, F_T_ENTER, double, now());
        PUT(buf, F_OP, uint8_t, self->op);
        PUT(buf, F_DTYPE, uint8_t, dt);
        PUT(buf, F_NDIM, uint8_t, ndim);
        PUT(buf, F_FLAGS, uint8_t, flags);
        PUT(buf, F_NTENSORS, uint8_t, 1);
        PUT(buf, F_GROUP, uint16_t, slot);
        PUT(buf, F_SITE, uint32_t, site);
        PUT(buf, F_STEP, uint64_t, state->step);
        PUT(buf, F_NUMEL, int64_t, numel);
        PUT(buf, F_PEER, int32_t, peer);
        for (int i = 0; i < 4 && i < ndim; i++) memcpy(buf + off_of[F_DIMS] + 8 * i, &dims[i], 8);
        PUT(buf, F_USER_SITE, uint32_t, user_site);
        PUT(buf, F_STAMP2, uint64_t, stamp);
        memcpy((char *)state->view.buf + off, buf, (size_t)record_size);
        goto recorded;
    failed:
        report_failure(rec, self->what);
    unrecorded:
        off = -1;
    recorded:;
    }

    depth++;
    PyObject *result = recorded_call_original(self, args, nargsf, kwnames);
    depth--;

    if (off >= 0) {
        if (result == NULL) {
            /* The original raised: the record says so, and the exception goes on unchanged. */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyObject *r = PyObject_CallMethod(rec, "finish", "nLii", off, stamp, status_error, 1);
            if (r == NULL) PyErr_Clear();
            Py_XDECREF(r);
            PyErr_Restore(type, value, tb);
        } else {
            long long span = 1;
            int ok = 1;
            if (self->spans && seqfn != NULL) {
                PyObject *v = PyObject_CallNoArgs(seqfn);
                if (v == NULL) {
                    ok = 0;
                } else {
                    span = PyLong_AsLongLong(v) - seq0;
                    Py_DECREF(v);
                    if (PyErr_Occurred()) ok = 0;
                }
            }
            if (ok && is_async) {
                PyObject *r;
                if (result == Py_None) { /* not a member of the group: nothing was issued */
                    r = PyObject_CallMethod(rec, "finish", "nLiL", off, stamp, status_ok, span);
                } else if (tracked != NULL && !self->is_p2p) { /* completes when the group's watermark passes it */
                    PyObject *queue = PyObject_GetAttr(tracked, s_enqueued);
                    r = queue ? PyObject_CallMethod(queue, "append", "((LnLL))", seq0 + span, off, stamp, span) : NULL;
                    Py_XDECREF(queue);
                } else {
                    PyObject *kw = Py_BuildValue("{sO}", "use_future", tracked == NULL ? Py_True : Py_False);
                    PyObject *fn = PyObject_GetAttr(rec, s_track_async);
                    PyObject *a = Py_BuildValue("(OnLL)", result, off, stamp, span);
                    r = (kw && fn && a) ? PyObject_Call(fn, a, kw) : NULL;
                    Py_XDECREF(kw);
                    Py_XDECREF(fn);
                    Py_XDECREF(a);
                }
                if (r == NULL) ok = 0;
                Py_XDECREF(r);
            } else if (ok && enqueue_on != NULL) {
                PyObject *queue = PyObject_GetAttr(enqueue_on, s_enqueued);
                PyObject *r = queue ? PyObject_CallMethod(queue, "append", "((LnLL))", seq0 + span, off, stamp, span) : NULL;
                Py_XDECREF(queue);
                if (r == NULL) ok = 0;
                Py_XDECREF(r);
            } else if (ok) {
                char exit_buf[MAX_RECORD];
                double t = now();
                uint32_t sp = (uint32_t)span;
                uint8_t st = (uint8_t)status_ok;
                Py_ssize_t base = off_of[F_T_EXIT];
                memcpy(exit_buf + off_of[F_T_EXIT] - base, &t, 8);
                memcpy(exit_buf + off_of[F_SEQ_SPAN] - base, &sp, 4);
                memcpy(exit_buf + off_of[F_STATUS] - base, &st, 1);
                if (state->mm != NULL && state->generation == generation) /* else: not the ring it began on */
                    memcpy((char *)state->view.buf + off + base, exit_buf, (size_t)(off_of[F_STATUS] + 1 - base));
            }
            if (!ok) report_failure(rec, self->what_end);
        }
    }
    Py_XDECREF(seqfn);
    Py_XDECREF(tracked);
    Py_XDECREF(enqueue_on);
    return result;
}

static int recorded_traverse(Recorded *self, visitproc visit, void *arg) {
    Py_VISIT(self->original);
    Py_VISIT(self->rec);
    Py_VISIT(self->state);
    Py_VISIT(self->groups);
    Py_VISIT(self->dict);
    return 0;
}

static int recorded_clear(Recorded *self) {
    Py_CLEAR(self->original);
    Py_CLEAR(self->rec);
    Py_CLEAR(self->state);
    Py_CLEAR(self->groups);
    Py_CLEAR(self->dict);
    Py_CLEAR(self->payload_name);
    Py_CLEAR(self->peer_name);
    Py_CLEAR(self->what);
    Py_CLEAR(self->what_end);
    return 0;
}

static void recorded_dealloc(Recorded *self) {
    PyObject_GC_UnTrack(self);
    if (self->weaklist != NULL) PyObject_ClearWeakRefs((PyObject *)self);
    recorded_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A function stored on a class binds like a Python function (torch patches none this way; kept correct). */
static PyObject *recorded_descr_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return PyMethod_New(self, obj);
}

static PyObject *recorded_new(PyTypeObject *type, PyObject *args, PyObject *kwds);

static PyMemberDef recorded_members[] = {
    {"__dtwatch_original__", T_OBJECT, offsetof(Recorded, original), READONLY, "the function this wrapper replaced"},
    {NULL}
};

static PyGetSetDef recorded_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL}
};

static PyTypeObject RecordedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dtwatch.record._fastpath.Recorded",
    .tp_doc = "A torch.distributed function recorded by dtwatch's native path.",
    .tp_basicsize = sizeof(Recorded),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = recorded_new,
    .tp_dealloc = (destructor)recorded_dealloc,
    .tp_traverse = (traverseproc)recorded_traverse,
    .tp_clear = (inquiry)recorded_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Recorded, vectorcall),
    .tp_descr_get = recorded_descr_get,
    .tp_dictoffset = offsetof(Recorded, dict),
    .tp_weaklistoffset = offsetof(Recorded, weaklist),
    .tp_members = recorded_members,
    .tp_getset = recorded_getset,
};

/* Recorded(original, rec, state, groups, op, flags, payload_pos, payload_name, group_pos, async_pos, peer_pos, peer_name,
 *          always_async, spans, is_p2p, tracked_sync, name) */
static PyObject *recorded_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *original, *rec, *state, *groups, *payload_name, *peer_name, *name;
    int op, flags, always_async, spans, is_p2p, tracked_sync;
    Py_ssize_t payload_pos, group_pos, async_pos, peer_pos;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Recorded() takes positional arguments only");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OOO!O!iinOnnnOppppU", &original, &rec, &StateType, &state, &PyDict_Type, &groups,
                          &op, &flags, &payload_pos, &payload_name,
                          &group_pos, &async_pos, &peer_pos, &peer_name, &always_async, &spans,
                          &is_p2p, &tracked_sync, &name))
        return NULL;
    if (record_size == 0) {
        PyErr_SetString(PyExc_RuntimeError, "configure() has not run");
        return NULL;
    }
    Recorded *self = (Recorded *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = recorded_vectorcall;
    Py_INCREF(original);
    self->original = original;
    Py_INCREF(rec);
    self->rec = rec;
    self->state = (State *)Py_NewRef(state);
    self->groups = Py_NewRef(groups);
    self->payload_name = payload_name == Py_None ? NULL : Py_NewRef(payload_name);
    self->peer_name = peer_name == Py_None ? NULL : Py_NewRef(peer_name);
    if (self->payload_name) PyUnicode_InternInPlace(&self->payload_name);
    if (self->peer_name) PyUnicode_InternInPlace(&self->peer_name);
    self->what = PyUnicode_FromFormat("recording %U", name);
    self->what_end = PyUnicode_FromFormat("recording the end of %U", name);
    if (self->what == NULL || self->what_end == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    self->op = op;
    self->flags = flags;
    self->payload_pos = payload_pos;
    self->group_pos = group_pos;
    self->async_pos = async_pos;
    self->peer_pos = peer_pos;
    self->always_async = always_async;
    self->spans = spans;
    self->is_p2p = is_p2p;
    self->tracked_sync = tracked_sync;
    return (PyObject *)self;
}

/* ---- module functions ------------------------------------------------------------------------------ */
/* configure(offsets: dict[name, (offset, size)], record_size, dtype_codes, numel_from_shape, flag_async,
 *           flag_enqueued, status_ok, status_error): the record's layout, checked against the sizes this file writes. */
static PyObject *configure(PyObject *module, PyObject *args) {
    PyObject *offsets, *codes;
    Py_ssize_t size;
    long long nfs;
    int fa, fe, so, se;
    if (!PyArg_ParseTuple(args, "O!nO!Liiii", &PyDict_Type, &offsets, &size, &PyDict_Type, &codes, &nfs, &fa, &fe,
                          &so, &se))
        return NULL;
    if (size <= 0 || size > MAX_RECORD) {
        PyErr_Format(PyExc_ValueError, "record size %zd outside 1..%d", size, MAX_RECORD);
        return NULL;
    }
    Py_ssize_t offs[N_FIELDS];
    for (int i = 0; i < N_FIELDS; i++) {
        PyObject *entry = PyDict_GetItemString(offsets, field_names[i]);
        Py_ssize_t o, s;
        if (entry == NULL || !PyArg_ParseTuple(entry, "nn", &o, &s)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "the record has no field %s of (offset, size)", field_names[i]);
            return NULL;
        }
        if (s != field_sizes[i] || o < 0 || o + s > size) {
            PyErr_Format(PyExc_ValueError, "record field %s: %zd bytes at %zd, this build writes %zd", field_names[i],
                         s, o, field_sizes[i]);
            return NULL;
        }
        offs[i] = o;
    }
    if (offs[F_SEQ_SPAN] < offs[F_T_EXIT] || offs[F_STATUS] < offs[F_SEQ_SPAN]) {
        PyErr_SetString(PyExc_ValueError, "the exit fields are not t_exit, seq_span, status in order");
        return NULL;
    }
    memcpy(off_of, offs, sizeof(offs));
    record_size = size;
    Py_INCREF(codes);
    Py_XSETREF(dtype_codes, codes);
    Py_CLEAR(last_dtype); /* new codes: the cached one may be stale */
    numel_from_shape = nfs;
    flag_async = fa;
    flag_enqueued = fe;
    status_ok = so;
    status_error = se;
    Py_RETURN_NONE;
}

static PyObject *inside(PyObject *module, PyObject *unused) {
    return PyBool_FromLong(depth > 0);
}

/* A composite call the Python wrapper makes (an object collective): the calls it makes inside are its own. */
static PyObject *enter(PyObject *module, PyObject *unused) {
    depth++;
    Py_RETURN_NONE;
}

static PyObject *leave(PyObject *module, PyObject *unused) {
    if (depth > 0) depth--;
    Py_RETURN_NONE;
}


static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "Give the record's layout (dtwatch.ring.layout)."},
    {"inside", inside, METH_NOARGS, "Whether this thread is inside a native wrapper's call."},
    {"enter", enter, METH_NOARGS, "A composite call starts on this thread (the Python wrapper's)."},
    {"leave", leave, METH_NOARGS, "It ended."},
    {NULL, NULL, 0, NULL}
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_fastpath", "dtwatch's native recording path (see dtwatch.record.native).", -1, methods,
};

#define INTERN(var, text)                                   \
    do {                                                    \
        var = PyUnicode_InternFromString(text);             \
        if (var == NULL) return NULL;                       \
    } while (0)

PyMODINIT_FUNC PyInit__fastpath(void) {
    INTERN(s_sites, "sites");
    INTERN(s_shape, "shape");
    INTERN(s_dtype, "dtype");
    INTERN(s_numel, "numel");
    INTERN(s_register_group, "register_group");
    INTERN(s_walk, "walk");
    INTERN(s_fail, "fail");
    INTERN(s_track_async, "track_async");
    INTERN(s_enqueued, "enqueued");
    INTERN(s_group, "group");
    INTERN(s_async_op, "async_op");
    if (PyType_Ready(&RecordedType) < 0 || PyType_Ready(&StateType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    if (PyModule_AddType(m, &RecordedType) < 0 || PyModule_AddType(m, &StateType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
