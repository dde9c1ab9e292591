/* Instances of a slotted Python class made from their field values, in C, through the
 * class's public protocols only: the one place where canaries' compiled cores make objects
 * of the package's own classes (canaries._columns.from_columns makes CanarySpans,
 * canaries._foldscan.exact_scan makes Hits), and the C twin of canaries.records, which
 * does the same in Python where the cores were not built.
 *
 * An instance is made exactly as `object.__new__(cls)` then `getattr(cls, name).__set__(
 * instance, value)` for each field would make it in Python: no __init__ (a frozen
 * dataclass's costs more per instance than the work that finds the values) and no layout
 * of the instance assumed: the fields are stored by their member descriptors' own
 * `__set__` (the descriptor protocol), object.__new__ is looked up on `object` and its
 * checks passed once per class (below). Every call is in the documented C API
 * (PyType_GetSlot: the stable ABI), so nothing here changes between minor versions.
 * Instances stay tracked by the cyclic collector, as any new object is.
 *
 * Only member descriptors (a `__slots__` entry, a `slots=True` dataclass field) are
 * accepted: storing through them runs no Python code, so a caller that reads a list's
 * items while it makes instances can count on the list not changing under it (with the
 * collector paused, nor can a finalizer). Include this in one .c file per module. */
#ifndef KVCANARY_RECORDS_H
#define KVCANARY_RECORDS_H

#define RECORD_MAX_FIELDS 16

typedef struct {
    PyObject *type;
    newfunc make;     /* object.__new__'s slot: object_new, checked once for type */
    PyObject *no_args; /* () */
    Py_ssize_t num_fields;
    PyObject *fields[RECORD_MAX_FIELDS]; /* each field's member descriptor */
    descrsetfunc store[RECORD_MAX_FIELDS];
} RecordMaker;

static void
record_maker_clear(RecordMaker *maker)
{
    for (Py_ssize_t f = 0; f < maker->num_fields; f++)
        Py_CLEAR(maker->fields[f]);
    Py_CLEAR(maker->type);
    Py_CLEAR(maker->no_args);
    maker->num_fields = 0;
}

/* Is object.__new__(type) allowed in Python? Calls it once, through `object.__new__`
 * itself (which refuses, say, a tuple subclass): then its slot, called for the
 * instances, makes what Python would. */
static int
record_check_new(PyObject *type)
{
    PyObject *object_new = PyObject_GetAttrString((PyObject *)&PyBaseObject_Type, "__new__");
    if (object_new == NULL)
        return -1;
    PyObject *probe = PyObject_CallOneArg(object_new, type);
    Py_DECREF(object_new);
    if (probe == NULL)
        return -1;
    Py_DECREF(probe);
    return 0;
}

/* Prepares maker for instances of type with the fields named by the strs in names. */
static int
record_maker_init(RecordMaker *maker, PyObject *type, PyObject *const *names,
                  Py_ssize_t num_fields)
{
    memset(maker, 0, sizeof *maker);
    if (!PyType_Check(type)) {
        PyErr_SetString(PyExc_TypeError, "instances of a class: type expected");
        return -1;
    }
    if (num_fields < 1 || num_fields > RECORD_MAX_FIELDS) {
        PyErr_Format(PyExc_ValueError, "1 to %d fields", RECORD_MAX_FIELDS);
        return -1;
    }
    const char *name_of_type = ((PyTypeObject *)type)->tp_name;
    Py_INCREF(type);
    maker->type = type;
    for (Py_ssize_t f = 0; f < num_fields; f++) {
        if (!PyUnicode_Check(names[f])) {
            PyErr_SetString(PyExc_TypeError, "field names must be strs");
            goto error;
        }
        PyObject *field = PyObject_GetAttr(type, names[f]);
        if (field == NULL)
            goto error;
        maker->fields[maker->num_fields++] = field;
        maker->store[f] = (descrsetfunc)PyType_GetSlot(Py_TYPE(field), Py_tp_descr_set);
        if (!Py_IS_TYPE(field, &PyMemberDescr_Type) || maker->store[f] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s.%U is not a slot", name_of_type, names[f]);
            goto error;
        }
    }
    maker->make = (newfunc)PyType_GetSlot(&PyBaseObject_Type, Py_tp_new);
    maker->no_args = PyTuple_New(0);
    if (maker->make == NULL || maker->no_args == NULL || record_check_new(type) < 0)
        goto error;
    return 0;
error:
    record_maker_clear(maker);
    return -1;
}

/* A new instance with field f = values[f] (borrowed); NULL with an exception set. */
static PyObject *
record_make(const RecordMaker *maker, PyObject *const *values)
{
    PyObject *item = maker->make((PyTypeObject *)maker->type, maker->no_args, NULL);
    if (item == NULL)
        return NULL;
    for (Py_ssize_t f = 0; f < maker->num_fields; f++) {
        if (maker->store[f](maker->fields[f], item, values[f]) < 0) {
            Py_DECREF(item);
            return NULL;
        }
    }
    return item;
}

#endif
