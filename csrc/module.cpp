// Python bindings: datastates._native. Every call that can block releases the GIL.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "copy.h"
#include "crc32c.h"
#include "io.h"

namespace py = pybind11;

namespace {

// Inputs at least this large are checksummed without the GIL (below it, releasing costs more than it gives).
constexpr Py_ssize_t kNoGilBytes = 64 * 1024;

// A contiguous, read-only view of any buffer-protocol object, released on scope exit.
class BufferView {
 public:
  explicit BufferView(const py::object& obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_SIMPLE) != 0) throw py::error_already_set();
  }
  ~BufferView() { PyBuffer_Release(&view_); }
  BufferView(const BufferView&) = delete;
  BufferView& operator=(const BufferView&) = delete;
  char* data() const { return static_cast<char*>(view_.buf); }
  Py_ssize_t size() const { return view_.len; }

 private:
  Py_buffer view_;
};

uint32_t crc_of_buffer(uint32_t (*fn)(uint32_t, const void*, size_t), const py::object& data, uint32_t value) {
  BufferView buf(data);  // holding the view keeps e.g. a bytearray from being resized meanwhile
  if (buf.size() < kNoGilBytes) return fn(value, buf.data(), size_t(buf.size()));
  py::gil_scoped_release nogil;
  return fn(value, buf.data(), size_t(buf.size()));
}

std::string fspath(const py::object& path) {
  return py::module_::import("os").attr("fspath")(path).cast<std::string>();
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() =
      "Native I/O for datastates: CRC-32C and a pool of threads doing aligned pwrite/pread (O_DIRECT where "
      "the file system accepts it) without the GIL. Raw pointers passed in must stay valid until waited.";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ds::OsError& e) {
      // OSError(errno, message): Python picks the subclass (FileNotFoundError, ...) from errno.
      PyObject* args = Py_BuildValue("(is)", e.err, e.msg.c_str());
      PyErr_SetObject(PyExc_OSError, args);
      Py_XDECREF(args);
    }
  });

  m.attr("ALIGNMENT") = ds::kAlign;
  m.attr("CHUNK_BYTES") = ds::kChunk;
  m.attr("crc32c_hardware") = ds::crc32c_hw_available();

  m.def(
      "crc32c", [](const py::object& data, uint32_t value) { return crc_of_buffer(ds::crc32c, data, value); },
      py::arg("data"), py::arg("value") = 0,
      "CRC-32C of a buffer-protocol object, continuing the running crc `value`.");
  m.def(
      "_crc32c_sw", [](const py::object& data, uint32_t value) { return crc_of_buffer(ds::crc32c_sw, data, value); },
      py::arg("data"), py::arg("value") = 0, "crc32c() on the portable table implementation (for tests).");
  m.def(
      "crc32c_ptr",
      [](uintptr_t ptr, uint64_t nbytes, uint32_t value) {
        return ds::crc32c(value, reinterpret_cast<const void*>(ptr), nbytes);
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("value") = 0, py::call_guard<py::gil_scoped_release>(),
      "CRC-32C of raw memory [ptr, ptr + nbytes).");

  py::class_<ds::File, std::shared_ptr<ds::File>>(m, "File")
      .def(py::init([](const py::object& path, const std::string& mode, const std::string& direct,
                       uint64_t preallocate, bool stream) {
             std::string p = fspath(path);
             py::gil_scoped_release nogil;
             return std::make_shared<ds::File>(std::move(p), mode, direct, preallocate, stream);
           }),
           py::arg("path"), py::arg("mode"), py::arg("direct") = "auto", py::arg("preallocate") = 0,
           py::arg("stream") = false)
      .def_property_readonly("stream", &ds::File::stream, "one sequential stream (see File in io.h)")
      .def_property_readonly("path", &ds::File::path)
      .def_property_readonly("direct", &ds::File::direct, "O_DIRECT actually in use")
      .def("size", &ds::File::size, py::call_guard<py::gil_scoped_release>())
      .def("fsync", &ds::File::fsync, py::call_guard<py::gil_scoped_release>())
      .def("truncate", &ds::File::truncate, py::arg("n"), py::call_guard<py::gil_scoped_release>())
      .def("close", &ds::File::close, py::call_guard<py::gil_scoped_release>())
      .def(
          "write",
          [](ds::File& f, uint64_t offset, const py::object& data) {
            BufferView buf(data);
            int err;
            uint64_t done;
            {
              py::gil_scoped_release nogil;
              err = f.transfer(true, buf.data(), uint64_t(buf.size()), offset, false, done);
            }
            if (err)
              throw ds::OsError(err, "pwrite '" + f.path() + "' at offset " + std::to_string(offset) + " (" +
                                         std::to_string(buf.size()) + " bytes): " + std::strerror(err));
          },
          py::arg("offset"), py::arg("data"), "Synchronous buffered pwrite of a buffer-protocol object.")
      .def(
          "read",
          [](ds::File& f, uint64_t offset, uint64_t nbytes) {
            py::bytes out(nullptr, nbytes);
            char* dst = PyBytes_AS_STRING(out.ptr());  // not yet shared, so it is ours to fill
            int err;
            uint64_t done;
            {
              py::gil_scoped_release nogil;
              err = f.transfer(false, dst, nbytes, offset, false, done);
            }
            if (err)
              throw ds::OsError(err, "pread '" + f.path() + "' at offset " + std::to_string(offset) + " (" +
                                         std::to_string(nbytes) + " bytes): " + std::strerror(err));
            if (done < nbytes)
              throw ds::OsError(ENODATA, "short read '" + f.path() + "': wanted " + std::to_string(nbytes) +
                                             " bytes at offset " + std::to_string(offset) + ", got " +
                                             std::to_string(done));
            return out;
          },
          py::arg("offset"), py::arg("nbytes"), "Synchronous buffered pread of exactly nbytes.")
      .def("__repr__", [](const ds::File& f) {
        return "<datastates._native.File '" + f.path() + "'" + (f.direct() ? " O_DIRECT>" : ">");
      });

  py::class_<ds::IOPool>(m, "IOPool")
      .def(py::init<int, int>(), py::arg("threads"), py::arg("nice") = 0)
      .def(
          "submit_write",
          [](ds::IOPool& p, std::shared_ptr<ds::File> file, uintptr_t ptr, uint64_t nbytes, uint64_t offset,
             std::vector<ds::IOPool::Segment> segments) {
            return p.submit(true, std::move(file), ptr, nbytes, offset, std::move(segments));
          },
          py::arg("file"), py::arg("ptr"), py::arg("nbytes"), py::arg("offset"),
          py::arg("segments") = std::vector<ds::IOPool::Segment>{},
          "Queue: crc32c of each (start, length) segment of [ptr, ptr + nbytes), then pwrite it at offset. "
          "Returns a ticket.")
      .def(
          "submit_read",
          [](ds::IOPool& p, std::shared_ptr<ds::File> file, uintptr_t ptr, uint64_t nbytes, uint64_t offset,
             std::vector<ds::IOPool::Segment> segments) {
            return p.submit(false, std::move(file), ptr, nbytes, offset, std::move(segments));
          },
          py::arg("file"), py::arg("ptr"), py::arg("nbytes"), py::arg("offset"),
          py::arg("segments") = std::vector<ds::IOPool::Segment>{},
          "Queue: pread nbytes at offset into ptr, then crc32c of each segment. Returns a ticket.")
      .def("wait", &ds::IOPool::wait, py::arg("ticket"), py::call_guard<py::gil_scoped_release>(),
           "Block until the ticket is done; return its segment crcs or raise its OSError.")
      .def("wait_all", &ds::IOPool::wait_all, py::call_guard<py::gil_scoped_release>(),
           "Block until every ticket not yet waited is done (forgetting them); raise the first error.")
      .def("close", &ds::IOPool::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("bytes_written", &ds::IOPool::bytes_written)
      .def_property_readonly("bytes_read", &ds::IOPool::bytes_read)
      .def_property_readonly("writes", &ds::IOPool::writes)
      .def_property_readonly("reads", &ds::IOPool::reads);

  py::class_<ds::CopyBatch, std::shared_ptr<ds::CopyBatch>>(
      m, "CopyBatch", "The completion of the copies queued into it (e.g. those filling one staging slot).")
      .def(py::init<>())
      .def("wait", &ds::CopyBatch::wait, py::call_guard<py::gil_scoped_release>(),
           "Block until every copy queued into this batch has landed.")
      .def("done", &ds::CopyBatch::done);

  py::class_<ds::Checksums, std::shared_ptr<ds::Checksums>>(
      m, "Checksums", "The crc32c of each range of a `CopyPool.checksum` request.")
      .def("wait", &ds::Checksums::wait, py::call_guard<py::gil_scoped_release>(),
           "Block until every range is checksummed; their crc32c, in order.");

  py::class_<ds::CopyPool>(m, "CopyPool")
      .def(py::init<int>(), py::arg("threads"))
      .def("copy", &ds::CopyPool::copy, py::arg("batch"), py::arg("dst"), py::arg("src"), py::arg("nbytes"),
           py::call_guard<py::gil_scoped_release>(),
           "Queue memcpy(dst, src, nbytes) on the pool's threads, counted in `batch`. Both ranges must stay "
           "valid until the batch is done.")
      .def("checksum", &ds::CopyPool::checksum, py::arg("after"), py::arg("ptr"), py::arg("ranges"),
           py::call_guard<py::gil_scoped_release>(),
           "Queue the crc32c of each (start, length) range of the memory at `ptr` on the pool's threads, once the "
           "copies of `after` (a CopyBatch whose copies are all queued, or None) have landed.")
      .def("run_copies", &ds::CopyPool::run_copies, py::call_guard<py::gil_scoped_release>(),
           "Run queued copies (never checksums) on the calling thread until none is queued; how many 4 MiB pieces "
           "it ran. A caller that waits for the copies lends its core to them.")
      .def("copies_queued", &ds::CopyPool::copies_queued, "Whether a copy is queued that no thread has taken yet.")
      .def("close", &ds::CopyPool::close, py::call_guard<py::gil_scoped_release>());
}
