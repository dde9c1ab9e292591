/* The scanner's compiled core: one pass over a str that folds it to aligned bytes and
 * finds the fragment windows and the tags (canaries.scanner_fast, steps 1 and 2).
 *
 * fold_scan(text, k, fold) reads the str's own buffer (no copy, any kind) and returns
 * (lowered, windows, tags), or None when some character does not fold one-to-one:
 *
 * - lowered: bytes aligned with text, exactly canaries.scanner_fast.fold_bytes(text):
 *   ASCII letters lower-cased, other ASCII characters unchanged, each BMP character to
 *   fold(code), the one-byte folding the Python side computes (0x7f, DEL, for "does not
 *   fold one-to-one"; such a folding, an astral character or, in a text that is not all
 *   ASCII, a literal DEL gives None).
 *   fold is called once per code point per process: its answers are cached here.
 * - windows: the starts p, in order, of every fragment window of k words in lowered:
 *   a separator at p, then k times six letters and a separator (letters a-z, digits 0-9,
 *   anything else a separator), as bytes.find of " aaaaaa" * k + " " finds in its shape.
 *   k < 1: no windows.
 * - tags: the starts, in order, of every "ydk" in lowered (it cannot overlap itself).
 *
 * Pure C over the str's code units plus a 64 Ki-entry table: the tests compare it with
 * fold_bytes and the shape search on random texts.
 */
#define _GNU_SOURCE /* memmem */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <structmember.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define WORD_LENGTH 6
#define HARMFUL 0x7f
#define UNKNOWN (-1)

static short fold_table[0x10000];

static int
lookup(Py_UCS4 code, PyObject *fold, unsigned char *out)
{
    if (code > 0xffff) {
        *out = HARMFUL;
        return 0;
    }
    short value = fold_table[code];
    if (value == UNKNOWN) {
        PyObject *answer = PyObject_CallFunction(fold, "I", (unsigned int)code);
        if (answer == NULL)
            return -1;
        long folded = PyLong_AsLong(answer);
        Py_DECREF(answer);
        if (folded == -1 && PyErr_Occurred())
            return -1;
        if (folded < 0 || folded > 0x7f) {
            PyErr_Format(PyExc_ValueError, "fold(%u) gave %ld, not an ASCII code",
                         (unsigned int)code, folded);
            return -1;
        }
        value = (short)folded;
        fold_table[code] = value;
    }
    *out = (unsigned char)value;
    return 0;
}

#define SEPARATOR 0
#define LETTER 1
#define DIGIT 2
static unsigned char class_of[256];

/* The fragment-window search, in locals of the loop below: letters since the last
 * separator (-1 once a digit broke the word, or before the first separator), run the
 * complete six-letter words, each closed by a separator, since the separator before the
 * first of them; a run of k or more ends a window at each separator. */
#define TAG_BYTES (('y' << 16) | ('d' << 8) | 'k')

typedef struct {
    Py_ssize_t k;
    PyObject *windows, *tags;
} Search;

static int
append_position(PyObject *list, Py_ssize_t position)
{
    PyObject *number = PyLong_FromSsize_t(position);
    if (number == NULL)
        return -1;
    int failed = PyList_Append(list, number);
    Py_DECREF(number);
    return failed;
}

/* Folds data[0:length] into out and feeds the search; 1 when a character does not fold
 * one-to-one, -1 on error, else 0. One loop per code-unit size; the state is kept in
 * locals (out may alias anything, so state behind a pointer would be reloaded). */
#define FOLD_LOOP(TYPE)                                                                  \
    static int fold_##TYPE(const TYPE *data, Py_ssize_t length, int ascii, PyObject *fold, \
                           unsigned char *out, Search *search)                           \
    {                                                                                    \
        const Py_ssize_t k = search->k < 1 ? PY_SSIZE_T_MAX : search->k;                 \
        const Py_ssize_t span = search->k < 1 ? 0 : k * (WORD_LENGTH + 1);             \
        Py_ssize_t letters = -1, run = 0;                                                \
        unsigned int recent = 0;                                                         \
        for (Py_ssize_t i = 0; i < length; i++) {                                        \
            Py_UCS4 code = data[i];                                                      \
            unsigned char byte;                                                          \
            if (code < 0x80)                                                             \
                byte = (unsigned char)fold_table[code];                                  \
            else if (lookup(code, fold, &byte) < 0)                                      \
                return -1;                                                               \
            if (byte == HARMFUL && !ascii)                                               \
                return 1;                                                                \
            out[i] = byte;                                                               \
            unsigned char kind = class_of[byte]; /* branch-free: words are short */     \
            int separator = kind == SEPARATOR;                                           \
            run = separator ? (letters == WORD_LENGTH ? run + 1 : 0) : run;              \
            letters = kind == LETTER ? letters + (letters >= 0) : kind == DIGIT ? -1 : 0; \
            if (separator && run >= k && append_position(search->windows, i - span) < 0) \
                return -1;                                                               \
            recent = ((recent << 8) | byte) & 0xffffff;                                  \
            if (recent == TAG_BYTES && append_position(search->tags, i - 2) < 0)         \
                return -1;                                                               \
        }                                                                                \
        return 0;                                                                        \
    }
FOLD_LOOP(Py_UCS1)
FOLD_LOOP(Py_UCS2)
FOLD_LOOP(Py_UCS4)

static PyObject *
fold_scan(PyObject *module, PyObject *args)
{
    PyObject *text, *fold;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "UnO:fold_scan", &text, &k, &fold))
        return NULL;
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(text) < 0)
        return NULL;
#endif
    Py_ssize_t length = PyUnicode_GET_LENGTH(text);
    const void *data = PyUnicode_DATA(text);
    int ascii = PyUnicode_IS_ASCII(text); /* as fold_bytes: DEL refused only beside non-ASCII */
    Search w = {k, NULL, NULL};
    PyObject *lowered = PyBytes_FromStringAndSize(NULL, length);
    w.windows = PyList_New(0);
    w.tags = PyList_New(0);
    if (lowered == NULL || w.windows == NULL || w.tags == NULL) {
        Py_XDECREF(lowered);
        Py_XDECREF(w.windows);
        Py_XDECREF(w.tags);
        return NULL;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(lowered);
    int result;
    switch (PyUnicode_KIND(text)) {
    case PyUnicode_1BYTE_KIND:
        result = fold_Py_UCS1(data, length, ascii, fold, out, &w);
        break;
    case PyUnicode_2BYTE_KIND:
        result = fold_Py_UCS2(data, length, ascii, fold, out, &w);
        break;
    default:
        result = fold_Py_UCS4(data, length, ascii, fold, out, &w);
    }
    if (result == 0)
        return Py_BuildValue("(NNN)", lowered, w.windows, w.tags);
    Py_DECREF(lowered);
    Py_DECREF(w.windows);
    Py_DECREF(w.tags);
    if (result < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* resolve_tags(text, tags, length, live, lowered, needle) -> (starts, canaries, owners,
 * seeds): canaries.scanner_fast's resolution of tag candidates, in one C loop.
 *
 * Candidates are tags (positions) or, when tags is None, every occurrence of needle in
 * text (found with PyUnicode_Find, str.find's own search). A candidate p is an exact
 * canary when 0 < p, p + length < len(text), the characters at p - 1 and p + length are
 * separators and text[p:p + length] is a key of live: separators by the shape of
 * lowered's bytes when lowered is bytes (aligned with text), else ASCII characters other
 * than letters and digits of text itself. Exact ones give their start, text and owner
 * (live's value); the others are seeds. With tags None, the search resumes after an exact
 * canary (no exact canary starts inside one), else after p. */
static int
is_separator_at(PyObject *text, const unsigned char *lowered, Py_ssize_t i)
{
    if (lowered != NULL)
        return class_of[lowered[i]] == SEPARATOR;
    Py_UCS4 code = PyUnicode_READ_CHAR(text, i);
    return code < 0x80 && class_of[code] == SEPARATOR;
}

/* The first occurrence of needle in text at or after from, -1 if none, -2 on error:
 * SSE2 compares of its first and last code units, then memmem over the code units (both
 * in text's kind; a match must start on a code unit): faster than str.find's search for
 * a needle of a few characters. */
static Py_ssize_t
find_needle(PyObject *text, PyObject *needle, Py_ssize_t from)
{
    int kind = PyUnicode_KIND(text);
    Py_ssize_t size = PyUnicode_GET_LENGTH(text), count = PyUnicode_GET_LENGTH(needle);
    if (PyUnicode_KIND(needle) > kind || count == 0 || count > 16)
        return PyUnicode_Find(text, needle, from, size, 1);
    unsigned char pattern[16 * 4];
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_UCS4 code = PyUnicode_READ_CHAR(needle, i);
        if (kind == PyUnicode_1BYTE_KIND)
            pattern[i] = (unsigned char)code;
        else if (kind == PyUnicode_2BYTE_KIND)
            ((Py_UCS2 *)pattern)[i] = (Py_UCS2)code;
        else
            ((Py_UCS4 *)pattern)[i] = code;
    }
    const char *data = PyUnicode_DATA(text);
#ifdef __SSE2__
    /* Where the first and the last code unit of the needle both match, 16 or 8 positions
     * at a time (x86-64 always has SSE2); memmem for the rest and for 4-byte kinds. */
    if (kind == PyUnicode_1BYTE_KIND) {
        const Py_UCS1 *units = (const Py_UCS1 *)data;
        __m128i first = _mm_set1_epi8((char)pattern[0]);
        __m128i last = _mm_set1_epi8((char)pattern[count - 1]);
        for (; from + count - 1 + 16 <= size; from += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(units + from));
            __m128i b = _mm_loadu_si128((const __m128i *)(units + from + count - 1));
            unsigned int mask = _mm_movemask_epi8(
                _mm_and_si128(_mm_cmpeq_epi8(a, first), _mm_cmpeq_epi8(b, last)));
            while (mask) {
                int bit = __builtin_ctz(mask);
                if (memcmp(units + from + bit, pattern, count) == 0)
                    return from + bit;
                mask &= mask - 1;
            }
        }
    }
    else if (kind == PyUnicode_2BYTE_KIND) {
        const Py_UCS2 *units = (const Py_UCS2 *)data;
        __m128i first = _mm_set1_epi16((short)((Py_UCS2 *)pattern)[0]);
        __m128i last = _mm_set1_epi16((short)((Py_UCS2 *)pattern)[count - 1]);
        for (; from + count - 1 + 8 <= size; from += 8) {
            __m128i a = _mm_loadu_si128((const __m128i *)(units + from));
            __m128i b = _mm_loadu_si128((const __m128i *)(units + from + count - 1));
            unsigned int mask = _mm_movemask_epi8(
                _mm_and_si128(_mm_cmpeq_epi16(a, first), _mm_cmpeq_epi16(b, last)));
            while (mask) {
                int bit = __builtin_ctz(mask); /* two mask bits per code unit */
                if (memcmp(units + from + bit / 2, pattern, count * 2) == 0)
                    return from + bit / 2;
                mask &= ~(3u << bit);
            }
        }
    }
#endif
    const char *at = data + from * kind, *stop = data + size * kind;
    while (at < stop) {
        const char *found = memmem(at, stop - at, pattern, count * kind);
        if (found == NULL)
            return -1;
        if ((found - data) % kind == 0)
            return (found - data) / kind;
        at = found + 1;
    }
    return -1;
}

static PyObject *
resolve_tags(PyObject *module, PyObject *args)
{
    PyObject *text, *tags, *live, *lowered_obj, *needle;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "UOnO!OU:resolve_tags", &text, &tags, &length, &PyDict_Type,
                          &live, &lowered_obj, &needle))
        return NULL;
    Py_ssize_t size = PyUnicode_GET_LENGTH(text);
    const unsigned char *lowered = NULL;
    if (lowered_obj != Py_None) {
        if (!PyBytes_Check(lowered_obj) || PyBytes_GET_SIZE(lowered_obj) != size) {
            PyErr_SetString(PyExc_ValueError, "lowered must be bytes as long as text");
            return NULL;
        }
        lowered = (const unsigned char *)PyBytes_AS_STRING(lowered_obj);
    }
    if (tags != Py_None && !PyList_Check(tags)) {
        PyErr_SetString(PyExc_TypeError, "tags must be a list or None");
        return NULL;
    }
    PyObject *starts = PyList_New(0), *canaries = PyList_New(0), *owners = PyList_New(0);
    PyObject *seeds = PyList_New(0);
    if (starts == NULL || canaries == NULL || owners == NULL || seeds == NULL)
        goto error;
    Py_ssize_t next = 0, from = 0;
    for (;;) {
        Py_ssize_t p;
        if (tags == Py_None) {
            p = find_needle(text, needle, from);
            if (p == -2)
                goto error;
            if (p < 0)
                break;
        }
        else {
            if (next >= PyList_GET_SIZE(tags))
                break;
            p = PyLong_AsSsize_t(PyList_GET_ITEM(tags, next++));
            if (p == -1 && PyErr_Occurred())
                goto error;
            if (p < 0 || p >= size) {
                PyErr_SetString(PyExc_ValueError, "a tag outside the text");
                goto error;
            }
        }
        Py_ssize_t end = p + length;
        PyObject *owner = NULL;
        if (p > 0 && end < size && is_separator_at(text, lowered, p - 1) &&
            is_separator_at(text, lowered, end)) {
            PyObject *canary = PyUnicode_Substring(text, p, end);
            if (canary == NULL)
                goto error;
            owner = PyDict_GetItemWithError(live, canary); /* borrowed */
            if (owner == NULL && PyErr_Occurred()) {
                Py_DECREF(canary);
                goto error;
            }
            if (owner != NULL) {
                int failed = append_position(starts, p) < 0 ||
                             PyList_Append(canaries, canary) < 0 ||
                             PyList_Append(owners, owner) < 0;
                Py_DECREF(canary);
                if (failed)
                    goto error;
            }
            else
                Py_DECREF(canary);
        }
        if (owner == NULL && append_position(seeds, p) < 0)
            goto error;
        from = owner != NULL ? end : p + 1;
    }
    return Py_BuildValue("(NNNN)", starts, canaries, owners, seeds);
error:
    Py_XDECREF(starts);
    Py_XDECREF(canaries);
    Py_XDECREF(owners);
    Py_XDECREF(seeds);
    return NULL;
}

/* exact_hits(hit_type, canaries, starts, base, length, layer, origins, owners) -> hits:
 * [hit_type(c, base + s, base + s + length, layer, c, origins[c], o) for c, s, o in
 * zip(canaries, starts, owners)], made as canaries.hit.hits_from_columns makes them
 * (allocated, then each slot stored; no __init__), with the cyclic collector paused for
 * the burst, and left untracked by it (below). hit_type must be a class whose __slots__
 * are exactly those seven fields. */
static const char *hit_fields[] = {"text", "start", "end", "layer", "canary", "origin", "owner"};
#define NUM_FIELDS 7

static PyObject *
exact_hits(PyObject *module, PyObject *args)
{
    PyTypeObject *type;
    PyObject *canaries, *starts, *layer, *origins, *owners;
    Py_ssize_t base, length;
    if (!PyArg_ParseTuple(args, "O!O!O!nnUO!O!:exact_hits", &PyType_Type, &type, &PyList_Type,
                          &canaries, &PyList_Type, &starts, &base, &length, &layer,
                          &PyDict_Type, &origins, &PyList_Type, &owners))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(canaries);
    if (PyList_GET_SIZE(starts) != count || PyList_GET_SIZE(owners) != count) {
        PyErr_SetString(PyExc_ValueError, "columns of different lengths");
        return NULL;
    }
    Py_ssize_t offsets[NUM_FIELDS];
    for (int f = 0; f < NUM_FIELDS; f++) {
        PyObject *descr = PyObject_GetAttrString((PyObject *)type, hit_fields[f]);
        if (descr == NULL)
            return NULL;
        int ok = Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
                 ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX;
        if (ok)
            offsets[f] = ((PyMemberDescrObject *)descr)->d_member->offset;
        Py_DECREF(descr);
        if (!ok) {
            PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", type->tp_name, hit_fields[f]);
            return NULL;
        }
    }
    PyObject *hits = PyList_New(count);
    if (hits == NULL)
        return NULL;
    int was_enabled = PyGC_Disable();
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *canary = PyList_GET_ITEM(canaries, i);
        Py_ssize_t start = PyLong_AsSsize_t(PyList_GET_ITEM(starts, i));
        if (start == -1 && PyErr_Occurred())
            goto error;
        PyObject *origin = PyDict_GetItemWithError(origins, canary); /* borrowed */
        if (origin == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, canary);
            goto error;
        }
        PyObject *values[NUM_FIELDS] = {
            canary, PyLong_FromSsize_t(base + start), PyLong_FromSsize_t(base + start + length),
            layer, canary, origin, PyList_GET_ITEM(owners, i),
        };
        if (values[1] == NULL || values[2] == NULL) {
            Py_XDECREF(values[1]);
            Py_XDECREF(values[2]);
            goto error;
        }
        PyObject *hit = type->tp_alloc(type, 0);
        if (hit == NULL) {
            Py_DECREF(values[1]);
            Py_DECREF(values[2]);
            goto error;
        }
        for (int f = 0; f < NUM_FIELDS; f++) {
            if (f != 1 && f != 2)
                Py_INCREF(values[f]);
            *(PyObject **)((char *)hit + offsets[f]) = values[f];
        }
        /* Untracked, as CPython untracks a tuple of atoms: a hit is new (nothing refers
         * to it but the list) and frozen, so it can join a reference cycle only if its
         * owner or origin is mutated to refer back to it. 10^5 hits then cost the
         * collector nothing. */
        PyObject_GC_UnTrack(hit);
        PyList_SET_ITEM(hits, i, hit);
    }
    if (was_enabled)
        PyGC_Enable();
    return hits;
error:
    if (was_enabled)
        PyGC_Enable();
    Py_DECREF(hits); /* unfilled items are NULL: list_dealloc skips them */
    return NULL;
}

/* outside(windows, starts, length, width) -> the windows [p, p + width) that overlap no
 * exact canary [s, s + length): both lists in order, the canaries not overlapping each
 * other (canaries.scanner_fast._outside, as one merge walk). */
static PyObject *
outside(PyObject *module, PyObject *args)
{
    PyObject *windows, *starts;
    Py_ssize_t length, width;
    if (!PyArg_ParseTuple(args, "O!O!nn:outside", &PyList_Type, &windows, &PyList_Type, &starts,
                          &length, &width))
        return NULL;
    PyObject *kept = PyList_New(0);
    if (kept == NULL)
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(starts), next = 0, last_end = PY_SSIZE_T_MIN;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(windows); i++) {
        PyObject *item = PyList_GET_ITEM(windows, i);
        Py_ssize_t begin = PyLong_AsSsize_t(item);
        if (begin == -1 && PyErr_Occurred())
            goto error;
        while (next < count) { /* the canaries starting before this window's end */
            Py_ssize_t start = PyLong_AsSsize_t(PyList_GET_ITEM(starts, next));
            if (start == -1 && PyErr_Occurred())
                goto error;
            if (start >= begin + width)
                break;
            last_end = start + length;
            next++;
        }
        if (last_end <= begin && PyList_Append(kept, item) < 0)
            goto error;
    }
    return kept;
error:
    Py_DECREF(kept);
    return NULL;
}

static PyMethodDef methods[] = {
    {"fold_scan", fold_scan, METH_VARARGS,
     "fold_scan(text, k, fold) -> (lowered, windows, tags) | None: see canaries/_foldscan.c."},
    {"resolve_tags", resolve_tags, METH_VARARGS,
     "resolve_tags(text, tags, length, live, lowered, needle) -> (starts, canaries, owners, "
     "seeds): see canaries/_foldscan.c."},
    {"outside", outside, METH_VARARGS,
     "outside(windows, starts, length, width) -> kept windows: see canaries/_foldscan.c."},
    {"exact_hits", exact_hits, METH_VARARGS,
     "exact_hits(hit_type, canaries, starts, base, length, layer, origins, owners) -> hits: "
     "see canaries/_foldscan.c."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "canaries._foldscan",
    "The scanner's compiled core (canaries.scanner_fast).", -1, methods,
};

PyMODINIT_FUNC
PyInit__foldscan(void)
{
    for (int code = 0; code < 0x10000; code++)
        fold_table[code] = UNKNOWN;
    for (int code = 0; code < 0x80; code++)
        fold_table[code] = (short)(code >= 'A' && code <= 'Z' ? code + 32 : code);
    memset(class_of, SEPARATOR, sizeof class_of);
    for (int c = 'a'; c <= 'z'; c++)
        class_of[c] = LETTER;
    for (int c = 'A'; c <= 'Z'; c++)
        class_of[c] = LETTER;
    for (int c = '0'; c <= '9'; c++)
        class_of[c] = DIGIT;
    return PyModule_Create(&module_def);
}
