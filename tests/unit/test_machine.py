"""The machine record that research results and benchmark tables carry (CPU model, vector ISA)."""

from __future__ import annotations

from ascender_dist import machine
from ascender_dist.research.ablate.provenance import report_provenance, run_provenance


def test_vector_isa_is_the_widest_flag_the_cpu_reports(monkeypatch):
    for flags, isa in (("fpu sse4_2 avx avx2 avx512f avx512dq", "avx512"), ("fpu sse4_2 avx avx2", "avx2"),
                       ("fpu", "unknown")):
        monkeypatch.setattr(machine, "_cpuinfo_field", lambda name, flags=flags: flags if name == "flags" else None)
        assert machine.vector_isa() == isa


def test_cpu_model_names_the_family_and_model_when_cpuinfo_has_them(monkeypatch):
    fields = {"model name": "AMD EPYC", "cpu family": "26", "model": "2"}
    monkeypatch.setattr(machine, "_cpuinfo_field", fields.get)
    assert machine.cpu_model() == "AMD EPYC family 26 model 2"
    fields.pop("cpu family")  # e.g. an ARM CPU: no x86 family number
    assert machine.cpu_model() == "AMD EPYC"


def test_runs_and_reports_record_the_machine():
    record = machine.machine_record()
    assert record["cpu"] and record["isa"] and record["logical_cpus"] >= 1
    assert run_provenance({"train": {"seed": 1}}, None)["machine"] == record
    assert report_provenance()["machine"] == record
    assert machine.machine_line(record).startswith(f"{record['cpu']} ({record['isa']}, ")
