"""`neorec checkpoint inspect DIR`: what a checkpoint holds, read from its manifest alone."""

from __future__ import annotations

from pathlib import Path

from neorec.checkpoint.files import check_file


def describe(folder: str | Path, verify: bool = False) -> str:
    """Step, world size, plan, tables with their pieces' ranges, files with sizes (and, with
    `verify`, each file checked against its size and checksum)."""
    return inspect_checkpoint(folder, verify)[0]


def inspect_checkpoint(folder: str | Path, verify: bool = False) -> tuple[str, list[str]]:
    """describe()'s text and, with `verify`, what is wrong with each bad file (missing, truncated,
    corrupted), one line each; an empty list when every file checks."""
    from neorec.checkpoint.load import read_manifest, resolve_checkpoint

    folder = resolve_checkpoint(folder)
    m = read_manifest(folder)
    plan = (m.get("plan") or {}).get("tables", {})
    state = m.get("state") or {}
    lines = [
        f"checkpoint  {folder}",
        f"step        {m['step']}  (saved {m.get('saved_at', '?')})",
        f"processes   {m['world_size']} ({m['local_world_size']} per node)",
        f"optimizer   {m['optimizer']['name']} (lr {m['optimizer']['lr']})",
    ]
    if state:
        lines.append(
            "state       " + ", ".join(f"{k} {v}" for k, v in state.items() if not isinstance(v, dict))
        )
    lines.append("tables:")
    by_table: dict[str, list[dict]] = {}
    for p in m["pieces"]:
        by_table.setdefault(p["table"], []).append(p)
    for t in m["tables"]:
        p = plan.get(t["name"], {"kind": "single process"})
        where = (
            p["kind"]
            + (f" ranks {p['ranks']}" if p.get("ranks") else "")
            + (f" node {p['node']}" if "node" in p else "")
        )
        opt = (t.get("optimizer") or m["optimizer"])["name"]
        lines.append(f"  {t['name']}: {t['rows']} x {t['dim']} {t['dtype']}, {opt}, {where}, "
                     f"step {m['embedding_steps'].get(t['name'], 0)}")  # fmt: skip
        for piece in by_table.get(t["name"], []):
            if piece["state"] != "weight":
                continue
            states = [
                q["state"]
                for q in by_table[t["name"]]
                if q["rows"] == piece["rows"] and q["cols"] == piece["cols"]
            ]
            (r0, r1), (c0, c1) = piece["rows"], piece["cols"]
            lines.append(f"    rows [{r0}, {r1}) cols [{c0}, {c1}) in {piece['file']}: {', '.join(states)}")
    lines.append("files:")
    entries = [*m["files"], {**m["dense"], "rank": 0}]
    total = 0
    problems: list[str] = []
    for f in entries:
        status = ""
        if verify:
            try:
                check_file(folder / f["name"], f["bytes"], f["crc32"])
                status = "  ok"
            except Exception as e:  # noqa: BLE001 - reported per file
                status = f"  BAD: {e}"
                problems.append(str(e))
        total += f["bytes"]
        lines.append(f"  {f['name']}  {f['bytes']:,} bytes  crc32 {f['crc32']:08x}{status}")
    checked = "" if verify else " (sizes and checksums as the manifest records them; --verify reads the files)"
    lines.append(f"total       {total / 2**20:.2f} MiB in {len(entries)} files + manifest.json{checked}")
    return "\n".join(lines), problems
