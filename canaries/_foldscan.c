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
 * windows and tags are packed positions: bytes holding C Py_ssize_t values (Python:
 * memoryview(b).cast("n")), for exact_scan below to read without making an int of each
 * (the echo of a 1M-token prompt holds ~10^5 tags and twice as many windows).
 *
 * Pure C over the str's code units plus a 64 Ki-entry table: the tests compare it with
 * fold_bytes and the shape search on random texts. exact_scan (below) then takes the tags
 * to exact hits in one loop (step 3's exact part).
 */
#define _GNU_SOURCE /* memmem */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "_records.h"
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
    Py_ssize_t *data, count, capacity;
} Positions;

static int
push(Positions *positions, Py_ssize_t position)
{
    if (positions->count == positions->capacity) {
        Py_ssize_t capacity = positions->capacity ? 2 * positions->capacity : 1024;
        Py_ssize_t *grown = PyMem_Realloc(positions->data, capacity * sizeof *grown);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        positions->data = grown, positions->capacity = capacity;
    }
    positions->data[positions->count++] = position;
    return 0;
}

/* The positions as packed bytes; frees them. */
static PyObject *
packed(Positions *positions)
{
    PyObject *bytes = PyBytes_FromStringAndSize(
        (const char *)positions->data, positions->count * (Py_ssize_t)sizeof(Py_ssize_t));
    PyMem_Free(positions->data);
    positions->data = NULL;
    return bytes;
}

typedef struct {
    Py_ssize_t k;
    Positions windows, tags;
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
            if (separator && run >= k && push(&search->windows, i - span) < 0)      \
                return -1;                                                               \
            recent = ((recent << 8) | byte) & 0xffffff;                                  \
            if (recent == TAG_BYTES && push(&search->tags, i - 2) < 0)                   \
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
    Search w = {k, {NULL, 0, 0}, {NULL, 0, 0}};
    PyObject *lowered = PyBytes_FromStringAndSize(NULL, length);
    if (lowered == NULL)
        return NULL;
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
    if (result == 0) {
        PyObject *windows = packed(&w.windows), *tags = packed(&w.tags);
        if (windows != NULL && tags != NULL)
            return Py_BuildValue("(NNN)", lowered, windows, tags);
        Py_XDECREF(windows);
        Py_XDECREF(tags);
        result = -1;
    }
    PyMem_Free(w.windows.data);
    PyMem_Free(w.tags.data);
    Py_DECREF(lowered);
    if (result < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* Whether text[i] separates words: by the shape of lowered[i] when lowered is given (the
 * folding, aligned with text), else when it is an ASCII character other than a letter or
 * a digit (such characters fold to a space in both readings). */
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

/* exact_scan(text, tags, length, live, resolved, lowered, needle, hit_type, base, after,
 *            until, windows, width) -> (hits, missing, seeds, kept): canaries.scanner_fast's
 * resolution of tag candidates and making of exact hits, in one C loop.
 *
 * Candidates are tags (packed positions, as fold_scan gives them) or, when tags is None,
 * every occurrence of needle in text (found with find_needle above). A candidate p is an
 * exact canary when 0 < p, p + length < len(text), the characters at p - 1 and p + length
 * are separators and c = text[p:p + length] is live: separators by the shape of lowered's
 * bytes when lowered is bytes (aligned with text), else ASCII characters other than
 * letters and digits of text itself; live when c is a key of resolved (the index's record
 * of live canaries already decoded: c -> (c, owner, origin)) or of live (c -> owner). The
 * others are seeds. With tags None, the search resumes after an exact canary (no exact
 * canary starts inside one), else after p.
 *
 * - hits: hit_type(c, base + p, base + p + length, "exact", c, origin, owner) for each
 *   exact canary in resolved ending in (after, until], absolute (c the resolved entry's
 *   own text: the hits share it), made as canaries.hit.hits_from_columns makes them
 *   (object.__new__, then each slot's own __set__: see _records.h).
 * - missing: the texts of the exact canaries live but not in resolved, in order: no hit
 *   is made for them; the caller decodes them, records them in resolved and scans again.
 * - kept: when windows is given (packed positions, in order), a list of the windows
 *   [w, w + width) that overlap no exact canary [p, p + length) (a merge walk: exact
 *   canaries never overlap each other); else None.
 *
 * One dict lookup per exact canary, no list of intermediate columns: the echo of a
 * 1M-token prompt holds ~10^5 of them. */
#define NUM_FIELDS 7
static const char *hit_fields[NUM_FIELDS] = {"text",   "start",  "end",  "layer",
                                             "canary", "origin", "owner"};
static PyObject *hit_field_names[NUM_FIELDS]; /* interned, at module init */
static PyObject *exact_layer;                 /* "exact", interned */

/* A hit of entry = (text, owner, origin) at [start, end), appended to hits. */
static int
append_hit(PyObject *hits, const RecordMaker *maker, PyObject *entry, Py_ssize_t start,
           Py_ssize_t end)
{
    PyObject *canary = PyTuple_GET_ITEM(entry, 0);
    PyObject *first = PyLong_FromSsize_t(start), *last = PyLong_FromSsize_t(end);
    PyObject *hit = NULL;
    if (first != NULL && last != NULL) {
        PyObject *values[NUM_FIELDS] = {
            canary, first, last, exact_layer, canary, PyTuple_GET_ITEM(entry, 2),
            PyTuple_GET_ITEM(entry, 1),
        };
        hit = record_make(maker, values);
    }
    Py_XDECREF(first);
    Py_XDECREF(last);
    if (hit == NULL)
        return -1;
    int failed = PyList_Append(hits, hit);
    Py_DECREF(hit);
    return failed;
}

/* The windows [w, w + width) that overlap none of the count exact canaries at starts. */
static PyObject *
windows_outside(const Py_ssize_t *begins, Py_ssize_t num_windows, const Py_ssize_t *starts,
                Py_ssize_t count, Py_ssize_t length, Py_ssize_t width)
{
    PyObject *kept = PyList_New(0);
    if (kept == NULL)
        return NULL;
    Py_ssize_t next = 0, last_end = PY_SSIZE_T_MIN;
    for (Py_ssize_t i = 0; i < num_windows; i++) {
        Py_ssize_t begin = begins[i];
        for (; next < count && starts[next] < begin + width; next++)
            last_end = starts[next] + length; /* canaries starting before the window's end */
        if (last_end <= begin && append_position(kept, begin) < 0) {
            Py_DECREF(kept);
            return NULL;
        }
    }
    return kept;
}

/* The key a candidate is looked up with: *probe = text[p:p + length], a new str, where that
 * text is all ASCII (no canary is anything else): 1 if so, 0 if not (*probe NULL), -1 on
 * error. The caller releases it. */
static int
new_probe(PyObject *text, Py_ssize_t p, Py_ssize_t length, PyObject **probe)
{
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    Py_UCS4 seen = 0;
    for (Py_ssize_t i = 0; i < length; i++)
        seen |= PyUnicode_READ(kind, data, p + i);
    *probe = NULL;
    if (seen >= 0x80)
        return 0;
    if ((*probe = PyUnicode_New(length, 127)) == NULL)
        return -1;
    Py_UCS1 *out = PyUnicode_1BYTE_DATA(*probe);
    for (Py_ssize_t i = 0; i < length; i++)
        out[i] = (Py_UCS1)PyUnicode_READ(kind, data, p + i);
    return 1;
}

/* The positions packed in bytes (or none, for None). */
static int
unpack(PyObject *bytes, const Py_ssize_t **positions, Py_ssize_t *count)
{
    if (bytes == Py_None)
        return 0;
    if (!PyBytes_Check(bytes) || PyBytes_GET_SIZE(bytes) % sizeof **positions != 0) {
        PyErr_SetString(PyExc_TypeError, "tags and windows must be packed positions or None");
        return -1;
    }
    *positions = (const Py_ssize_t *)PyBytes_AS_STRING(bytes);
    *count = PyBytes_GET_SIZE(bytes) / (Py_ssize_t)sizeof **positions;
    return 0;
}

static PyObject *
exact_scan(PyObject *module, PyObject *args)
{
    PyObject *text, *tags, *live, *resolved, *lowered_obj, *needle, *windows;
    PyTypeObject *type;
    Py_ssize_t length, base, after, until, width;
    if (!PyArg_ParseTuple(args, "UOnO!O!OUO!nnnOn:exact_scan", &text, &tags, &length,
                          &PyDict_Type, &live, &PyDict_Type, &resolved, &lowered_obj, &needle,
                          &PyType_Type, &type, &base, &after, &until, &windows, &width))
        return NULL;
    Py_ssize_t size = PyUnicode_GET_LENGTH(text);
    if (length < 1) {
        PyErr_SetString(PyExc_ValueError, "length must be positive");
        return NULL;
    }
    const unsigned char *lowered = NULL;
    if (lowered_obj != Py_None) {
        if (!PyBytes_Check(lowered_obj) || PyBytes_GET_SIZE(lowered_obj) != size) {
            PyErr_SetString(PyExc_ValueError, "lowered must be bytes as long as text");
            return NULL;
        }
        lowered = (const unsigned char *)PyBytes_AS_STRING(lowered_obj);
    }
    const Py_ssize_t *tag_at = NULL, *window_at = NULL;
    Py_ssize_t num_tags = 0, num_windows = 0;
    if (unpack(tags, &tag_at, &num_tags) < 0 || unpack(windows, &window_at, &num_windows) < 0)
        return NULL;
    RecordMaker maker;
    if (record_maker_init(&maker, (PyObject *)type, hit_field_names, NUM_FIELDS) < 0)
        return NULL;
    PyObject *hits = PyList_New(0), *missing = PyList_New(0), *seeds = PyList_New(0);
    PyObject *kept = NULL;
    Positions starts = {NULL, 0, 0}; /* of the exact canaries */
    PyObject *probe = NULL;
    int was_enabled = PyGC_Disable();
    if (hits == NULL || missing == NULL || seeds == NULL)
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
            if (next >= num_tags)
                break;
            p = tag_at[next++];
            if (p < 0 || p >= size) {
                PyErr_SetString(PyExc_ValueError, "a tag outside the text");
                goto error;
            }
        }
        Py_ssize_t end = p + length;
        int exact = 0;
        if (p > 0 && end < size && is_separator_at(text, lowered, p - 1) &&
            is_separator_at(text, lowered, end)) {
            int ascii = new_probe(text, p, length, &probe);
            if (ascii < 0)
                goto error;
            PyObject *entry = NULL;
            if (ascii) /* no canary is anything else */
                entry = PyDict_GetItemWithError(resolved, probe); /* borrowed */
            int failed = entry == NULL && PyErr_Occurred();
            if (entry != NULL) {
                exact = 1;
                if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3) {
                    PyErr_SetString(PyExc_TypeError, "resolved entries must be 3-tuples");
                    failed = 1;
                }
                else if (after < base + end && base + end <= until)
                    failed = append_hit(hits, &maker, entry, base + p, base + end) < 0;
            }
            else if (ascii && !failed) {
                PyObject *owner = PyDict_GetItemWithError(live, probe); /* borrowed */
                failed = owner == NULL && PyErr_Occurred();
                exact = owner != NULL;
                if (exact)
                    failed = PyList_Append(missing, probe) < 0;
            }
            Py_CLEAR(probe);
            if (failed)
                goto error;
        }
        if (exact) {
            if (push(&starts, p) < 0)
                goto error;
        }
        else if (append_position(seeds, p) < 0)
            goto error;
        from = exact ? end : p + 1;
    }
    if (was_enabled)
        PyGC_Enable();
    was_enabled = 0;
    if (windows == Py_None) {
        kept = Py_None;
        Py_INCREF(kept);
    }
    else if ((kept = windows_outside(window_at, num_windows, starts.data, starts.count, length,
                                     width)) == NULL)
        goto error;
    PyMem_Free(starts.data);
    record_maker_clear(&maker);
    return Py_BuildValue("(NNNN)", hits, missing, seeds, kept);
error:
    if (was_enabled)
        PyGC_Enable();
    PyMem_Free(starts.data);
    record_maker_clear(&maker);
    Py_XDECREF(probe);
    Py_XDECREF(hits);
    Py_XDECREF(missing);
    Py_XDECREF(seeds);
    return NULL;
}

static PyMethodDef methods[] = {
    {"fold_scan", fold_scan, METH_VARARGS,
     "fold_scan(text, k, fold) -> (lowered, windows, tags) | None: see canaries/_foldscan.c."},
    {"exact_scan", exact_scan, METH_VARARGS,
     "exact_scan(text, tags, length, live, resolved, lowered, needle, hit_type, base, after, "
     "until, windows, width) -> (hits, missing, seeds, kept): see canaries/_foldscan.c."},
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
    exact_layer = PyUnicode_InternFromString("exact");
    if (exact_layer == NULL)
        return NULL;
    for (int f = 0; f < NUM_FIELDS; f++)
        if ((hit_field_names[f] = PyUnicode_InternFromString(hit_fields[f])) == NULL)
            return NULL;
    return PyModule_Create(&module_def);
}
