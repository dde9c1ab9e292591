/* Many small objects from columns, compiled (canaries.span, canaries.mint).
 *
 * A 1,048,576-token prompt holds ~10^5 canaries; making their texts and spans one Python
 * call at a time costs more than minting them. Both functions below give exactly what the
 * pure-Python code beside them gives (the tests compare them on random columns):
 *
 * - spell(digits, table, row, prefix) -> list[str]: for each row d of digits (a 2-d
 *   C-contiguous int64 buffer), prefix followed by the table's rows (of row bytes each)
 *   numbered d[0], d[1], ...: (prefix + b"".join(rows[d])).decode("ascii") with rows the
 *   table cut into rows, as canaries.mint.CanaryMinter.spell spells canaries. Non-ASCII
 *   bytes: ValueError; a digit outside the table's rows: IndexError.
 * - from_columns(type, fields, *columns) -> tuple: for each row i, an instance of type
 *   with field fields[f] = columns[f][i], made as canaries.span.spans_from_columns makes
 *   it (allocated, then each slot stored; no __init__). type must be a plain class whose
 *   fields are slots; every column a list or tuple as long as the first. An instance all
 *   of whose values are str, int or None is left untracked by the cyclic collector, as
 *   CPython untracks a tuple of atoms: it cannot be part of a reference cycle.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

static int
check_ascii(const unsigned char *data, Py_ssize_t size, const char *name)
{
    unsigned char high = 0;
    for (Py_ssize_t i = 0; i < size; i++)
        high |= data[i];
    if (high & 0x80) {
        PyErr_Format(PyExc_ValueError, "%s holds non-ASCII bytes", name);
        return -1;
    }
    return 0;
}

static PyObject *
spell(PyObject *module, PyObject *args)
{
    PyObject *digits_obj;
    Py_buffer table, prefix;
    Py_ssize_t row;
    if (!PyArg_ParseTuple(args, "Oy*ny*:spell", &digits_obj, &table, &row, &prefix))
        return NULL;
    Py_buffer digits;
    if (PyObject_GetBuffer(digits_obj, &digits, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&table);
        PyBuffer_Release(&prefix);
        return NULL;
    }
    PyObject *result = NULL;
    const char *format = digits.format ? digits.format : "B";
    if (digits.ndim != 2 || digits.itemsize != 8 ||
        (strcmp(format, "l") != 0 && strcmp(format, "q") != 0 && strcmp(format, "<q") != 0 &&
         strcmp(format, "=q") != 0 && strcmp(format, "<l") != 0 && strcmp(format, "=l") != 0)) {
        PyErr_SetString(PyExc_TypeError, "digits must be a 2-d C-contiguous int64 buffer");
        goto done;
    }
    if (row < 1 || table.len % row != 0) {
        PyErr_SetString(PyExc_ValueError, "row must be positive and divide the table");
        goto done;
    }
    if (check_ascii(table.buf, table.len, "table") < 0 ||
        check_ascii(prefix.buf, prefix.len, "prefix") < 0)
        goto done;
    Py_ssize_t count = digits.shape[0], per_row = digits.shape[1], num_rows = table.len / row;
    Py_ssize_t width = prefix.len + per_row * row;
    const int64_t *cells = digits.buf;
    for (Py_ssize_t i = 0; i < count * per_row; i++) {
        if (cells[i] < 0 || cells[i] >= num_rows) {
            PyErr_Format(PyExc_IndexError, "digit %lld outside the table's %zd rows",
                         (long long)cells[i], num_rows);
            goto done;
        }
    }
    result = PyList_New(count);
    if (result == NULL)
        goto done;
    const char *rows = table.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *text = PyUnicode_New(width, 127);
        if (text == NULL) {
            Py_CLEAR(result); /* unfilled items are NULL: list_dealloc skips them */
            goto done;
        }
        char *out = PyUnicode_DATA(text);
        memcpy(out, prefix.buf, prefix.len);
        out += prefix.len;
        for (Py_ssize_t w = 0; w < per_row; w++, out += row)
            memcpy(out, rows + cells[i * per_row + w] * row, row);
        PyList_SET_ITEM(result, i, text);
    }
done:
    PyBuffer_Release(&digits);
    PyBuffer_Release(&table);
    PyBuffer_Release(&prefix);
    return result;
}

#define MAX_FIELDS 16

static int
is_atom(PyObject *value)
{
    return value == Py_None || PyUnicode_CheckExact(value) || PyLong_CheckExact(value);
}

static PyObject *
from_columns(PyObject *module, PyObject *args)
{
    Py_ssize_t num_args = PyTuple_GET_SIZE(args);
    if (num_args < 2) {
        PyErr_SetString(PyExc_TypeError, "from_columns(type, fields, *columns)");
        return NULL;
    }
    PyObject *type_obj = PyTuple_GET_ITEM(args, 0), *fields = PyTuple_GET_ITEM(args, 1);
    if (!PyType_Check(type_obj) || !PyTuple_Check(fields)) {
        PyErr_SetString(PyExc_TypeError, "from_columns(type, fields: tuple, *columns)");
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)type_obj;
    Py_ssize_t num_fields = PyTuple_GET_SIZE(fields);
    if (num_fields < 1 || num_fields > MAX_FIELDS || num_args - 2 != num_fields) {
        PyErr_Format(PyExc_ValueError, "1 to %d fields, one column each", MAX_FIELDS);
        return NULL;
    }
    if (type->tp_itemsize != 0 || type->tp_alloc == NULL) {
        PyErr_Format(PyExc_TypeError, "%s is not a plain slotted class", type->tp_name);
        return NULL;
    }
    Py_ssize_t offsets[MAX_FIELDS];
    PyObject **columns[MAX_FIELDS];
    Py_ssize_t count = 0;
    for (Py_ssize_t f = 0; f < num_fields; f++) {
        PyObject *name = PyTuple_GET_ITEM(fields, f);
        PyObject *descr = PyUnicode_Check(name) ? PyObject_GetAttr(type_obj, name) : NULL;
        if (descr == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "field names must be strs");
            return NULL;
        }
        int ok = Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
                 ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX;
        if (ok)
            offsets[f] = ((PyMemberDescrObject *)descr)->d_member->offset;
        Py_DECREF(descr);
        if (!ok) {
            PyErr_Format(PyExc_TypeError, "%s.%U is not a slot", type->tp_name, name);
            return NULL;
        }
    }
    for (Py_ssize_t f = 0; f < num_fields; f++) { /* after every lookup: no code runs now */
        PyObject *column = PyTuple_GET_ITEM(args, 2 + f);
        if (!PyList_Check(column) && !PyTuple_Check(column)) {
            PyErr_SetString(PyExc_TypeError, "every column must be a list or a tuple");
            return NULL;
        }
        Py_ssize_t size = PySequence_Fast_GET_SIZE(column);
        if (f == 0)
            count = size;
        else if (size != count) {
            PyErr_SetString(PyExc_ValueError, "columns of different lengths");
            return NULL;
        }
        columns[f] = PySequence_Fast_ITEMS(column);
    }
    /* The collector is paused from here on: no collection, so no finalizer or other
     * Python code runs below and the columns cannot change under the loop. */
    int was_enabled = PyGC_Disable();
    PyObject *result = PyTuple_New(count);
    if (result == NULL) {
        if (was_enabled)
            PyGC_Enable();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = type->tp_alloc(type, 0);
        if (item == NULL) {
            if (was_enabled)
                PyGC_Enable();
            Py_DECREF(result); /* unfilled items are NULL: tupledealloc skips them */
            return NULL;
        }
        int atoms = 1;
        for (Py_ssize_t f = 0; f < num_fields; f++) {
            PyObject *value = columns[f][i];
            atoms &= is_atom(value);
            PyObject **slot = (PyObject **)((char *)item + offsets[f]);
            Py_INCREF(value);
            Py_XSETREF(*slot, value);
        }
        if (atoms && PyObject_IS_GC(item) && PyObject_GC_IsTracked(item))
            PyObject_GC_UnTrack(item);
        PyTuple_SET_ITEM(result, i, item);
    }
    if (was_enabled)
        PyGC_Enable();
    return result;
}

static PyMethodDef methods[] = {
    {"spell", spell, METH_VARARGS,
     "spell(digits, table, row, prefix) -> list[str]: see canaries/_columns.c."},
    {"from_columns", from_columns, METH_VARARGS,
     "from_columns(type, fields, *columns) -> tuple: see canaries/_columns.c."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "canaries._columns",
    "Many small objects from columns, compiled (canaries.span, canaries.mint).", -1, methods,
};

PyMODINIT_FUNC
PyInit__columns(void)
{
    return PyModule_Create(&module_def);
}
