# shellcheck shell=bash
# The Debian mirrors of this machine, for making a root filesystem of another Debian release
# (scripts/compose.sh's base image, bench/python_root.sh). Sourced; defines one function:
#
#   debian_sources SUITE [APT_DIR]   one "deb URI SUITE[-updates|-security] COMPONENTS" line per
#                                    Debian source this machine's apt uses (APT_DIR, /etc/apt by
#                                    default: its deb822 files and sources.list), the release part of
#                                    each suite replaced by SUITE
#
# The mirror is the machine's own (its apt sources may point at a local mirror or a proxy): no host is
# written in the repository. mmdebstrap takes each printed line as one mirror argument.

debian_sources() {
    local suite="$1" apt="${2:-/etc/apt}" file files=()
    for file in "$apt/sources.list" "$apt"/sources.list.d/*.list "$apt"/sources.list.d/*.sources; do
        [[ -f "$file" ]] && files+=("$file")
    done
    [[ ${#files[@]} -gt 0 ]] || return 0
    awk -v suite="$suite" '
        # a suite such as bookworm-security -> trixie-security; the pocket after the release is kept
        function renamed(s,   dash) {
            dash = index(s, "-")
            return dash ? suite substr(s, dash) : suite
        }
        function emit(uri, suites, components,   n, i, parts) {
            if (uri == "" || suites == "" || uri !~ /debian/) return
            n = split(suites, parts, /[ \t]+/)
            for (i = 1; i <= n; i++) {
                if (parts[i] == "") continue
                line = "deb " uri " " renamed(parts[i]) " " (components == "" ? "main" : components)
                if (!(line in seen)) { seen[line] = 1; print line }
            }
        }
        function flush() {
            if (types ~ /(^|[ \t])deb([ \t]|$)/) emit(uris, suites_, comps)
            types = uris = suites_ = comps = ""
        }
        FILENAME ~ /\.sources$/ {
            if (FNR == 1) flush()
            if ($0 ~ /^[ \t]*$/) { flush(); next }
            if ($0 ~ /^#/) next
            key = $1; sub(/:$/, "", key); $1 = ""; sub(/^[ \t]+/, "")
            if (key == "Types") types = $0
            else if (key == "URIs") { uris = $1 }
            else if (key == "Suites") suites_ = $0
            else if (key == "Components") comps = $0
            next
        }
        /^[ \t]*deb[ \t]/ {
            flush()
            i = 2
            if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
            uri = $i; s = $(i + 1); c = ""
            for (j = i + 2; j <= NF; j++) c = c (c == "" ? "" : " ") $j
            emit(uri, s, c)
        }
        END { flush() }
    ' "${files[@]}"
}
