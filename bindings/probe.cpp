// tierzero.info(): the capability probe (tierzero/common/probe.h) as dicts,
// the same facts `tierzero-info --json` prints.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "errors.h"
#include "tierzero/common.h"

namespace tzpy {
namespace {

nb::list strings(const std::vector<std::string>& v) {
  nb::list out;
  for (const std::string& s : v) out.append(nb::str(s.c_str()));
  return out;
}

nb::dict uring_dict(const tz::UringCapabilities& u) {
  nb::dict d;
  d["available"] = u.available;
  d["unavailable_reason"] = u.unavailable_reason;
  d["features"] = u.features;
  d["has_op_read"] = u.has_op_read;
  d["has_op_write"] = u.has_op_write;
  d["has_op_read_fixed"] = u.has_op_read_fixed;
  d["has_op_write_fixed"] = u.has_op_write_fixed;
  d["has_op_fsync"] = u.has_op_fsync;
  d["has_op_fallocate"] = u.has_op_fallocate;
  d["missing_ops"] = strings(u.missing_ops);
  return d;
}

nb::dict cpu_dict(const tz::CpuCapabilities& c) {
  nb::dict d;
  d["model"] = c.model;
  d["logical_cpus"] = c.logical_cpus;
  d["sse4_2"] = c.sse4_2;
  d["avx2"] = c.avx2;
  d["fma"] = c.fma;
  d["f16c"] = c.f16c;
  d["avx512f"] = c.avx512f;
  d["avx512bw"] = c.avx512bw;
  d["avx512vl"] = c.avx512vl;
  d["avx512_bf16"] = c.avx512_bf16;
  d["avx512_fp16"] = c.avx512_fp16;
  d["best_simd"] = c.best_simd;
  return d;
}

nb::dict cuda_dict(const tz::CudaCapabilities& c) {
  nb::dict d;
  d["compiled"] = c.compiled;
  d["device_count"] = c.device_count;
  d["status"] = c.status;
  d["driver_version"] = c.driver_version;
  d["runtime_version"] = c.runtime_version;
  nb::list devices;
  for (const tz::GpuDevice& g : c.devices) {
    nb::dict gd;
    gd["index"] = g.index;
    gd["name"] = g.name;
    gd["compute_capability"] = nb::make_tuple(g.cc_major, g.cc_minor);
    gd["total_memory_bytes"] = g.total_memory_bytes;
    gd["pci_bus_id"] = g.pci_bus_id;
    gd["numa_node"] = g.numa_node;
    devices.append(gd);
  }
  d["devices"] = devices;
  return d;
}

nb::dict capabilities_dict(const tz::Capabilities& caps) {
  nb::dict d;
  d["kernel_release"] = caps.kernel_release;
  d["io_uring"] = uring_dict(caps.uring);
  d["cpu"] = cpu_dict(caps.cpu);
  nb::list nodes;
  for (const tz::NumaNode& n : caps.numa_nodes) {
    nb::dict nd;
    nd["os_index"] = n.os_index;
    nb::list cpus;
    for (int c : n.cpus) cpus.append(c);
    nd["cpus"] = cpus;
    nd["memory_bytes"] = n.memory_bytes;
    nodes.append(nd);
  }
  d["numa_nodes"] = nodes;
  d["numa_error"] = caps.numa_error;
  nb::dict mem;
  mem["total_bytes"] = caps.memory.total_bytes;
  mem["available_bytes"] = caps.memory.available_bytes;
  mem["memlock_limit_bytes"] = caps.memory.memlock_limit_bytes;
  mem["cap_ipc_lock"] = caps.memory.cap_ipc_lock;
  mem["transparent_hugepage"] = caps.memory.transparent_hugepage;
  d["memory"] = mem;
  d["cuda"] = cuda_dict(caps.cuda);
  return d;
}

nb::dict path_dict(const tz::PathCapabilities& p) {
  nb::dict d;
  d["path"] = p.path;
  d["filesystem"] = p.filesystem;
  d["device"] = p.device;
  d["total_bytes"] = p.total_bytes;
  d["free_bytes"] = p.free_bytes;
  d["o_direct_accepted"] = p.o_direct_accepted;
  d["o_direct"] = p.o_direct;
  d["dio_mem_align"] = p.dio_mem_align;
  d["dio_offset_align"] = p.dio_offset_align;
  d["note"] = p.note;
  return d;
}

}  // namespace

void bind_probe(nb::module_& m) {
  m.def(
      "capabilities",
      [](bool refresh) {
        // The first probe opens an io_uring, queries hwloc and CUDA: not under the GIL.
        tz::Capabilities caps;
        {
          nb::gil_scoped_release release;
          caps = refresh ? tz::probe_capabilities() : tz::capabilities();
        }
        return capabilities_dict(caps);
      },
      nb::arg("refresh") = false,
      "What this machine can do (io_uring, CPU SIMD, NUMA, memory, CUDA) as a dict; probed once per process "
      "(refresh=True probes again).");
  m.def(
      "describe_capabilities",
      [] {
        nb::gil_scoped_release release;
        return tz::describe(tz::capabilities());
      },
      "The probe as tierzero-info prints it.");
  m.def(
      "probe_path",
      [](const std::string& directory) {
        tz::Expected<tz::PathCapabilities> p = [&] {
          nb::gil_scoped_release release;  // writes and reads a file with O_DIRECT
          return tz::probe_path(directory);
        }();
        return path_dict(value_or_raise(std::move(p)));
      },
      nb::arg("directory"),
      "A directory for the NVMe tier: file system, device, free space, whether O_DIRECT really bypasses the page "
      "cache and with what alignment. FileNotFoundError / PermissionError / OSError name the path.");
}

}  // namespace tzpy
