/* A tiny NVTX tool: writes every range push and pop of a process to a text file.
 *
 * NVTX is a header-only API: the first NVTX call in a process reads NVTX_INJECTION64_PATH,
 * dlopens the library it names and calls its InitializeInjectionNvtx2, which fills NVTX's
 * function tables with the tool's handlers. Nsight Systems is such a tool; this is a minimal
 * one, so a test can prove that minispeed's ranges reach NVTX without a GPU or Nsight.
 *
 * Output (MINISPEED_NVTX_CAPTURE names the file), one line per event:
 *   push <message>
 *   pop
 *
 * Build: gcc -shared -fPIC -I<dir holding nvtx3/> nvtx_capture.c -o libnvtx_capture.so
 */
#define NVTX_NO_IMPL
#include <nvtx3/nvToolsExt.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static FILE *capture_file = NULL;

static void emit_push(const char *message) {
    if (capture_file) {
        fprintf(capture_file, "push %s\n", message ? message : "(null)");
        fflush(capture_file);
    }
}

static void emit_pop(void) {
    if (capture_file) {
        fputs("pop\n", capture_file);
        fflush(capture_file);
    }
}

/* A registered string's handle is a copy of the string itself. */
static const char *message_of(const nvtxEventAttributes_t *attr) {
    if (!attr) return NULL;
    switch (attr->messageType) {
        case NVTX_MESSAGE_TYPE_ASCII: return attr->message.ascii;
        case NVTX_MESSAGE_TYPE_REGISTERED: return (const char *)attr->message.registered;
        default: return "(unsupported message type)";
    }
}

static int NVTX_API push_a(const char *message) { emit_push(message); return 0; }
static int NVTX_API push_ex(const nvtxEventAttributes_t *attr) { emit_push(message_of(attr)); return 0; }
static int NVTX_API pop(void) { emit_pop(); return 0; }
static int NVTX_API domain_push_ex(nvtxDomainHandle_t d, const nvtxEventAttributes_t *attr) {
    (void)d; emit_push(message_of(attr)); return 0;
}
static int NVTX_API domain_pop(nvtxDomainHandle_t d) { (void)d; emit_pop(); return 0; }
static nvtxStringHandle_t NVTX_API register_string_a(nvtxDomainHandle_t d, const char *s) {
    (void)d; return (nvtxStringHandle_t)strdup(s);
}
static nvtxDomainHandle_t NVTX_API domain_create_a(const char *name) {
    return (nvtxDomainHandle_t)strdup(name);
}

static void set_entry(NvtxFunctionTable table, unsigned int size, unsigned int id, NvtxFunctionPointer fn) {
    if (id < size && table[id]) *table[id] = fn;
}

NVTX_DYNAMIC_EXPORT int NVTX_API InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_export_table) {
    const NvtxExportTableCallbacks *callbacks =
        (const NvtxExportTableCallbacks *)get_export_table(NVTX_ETID_CALLBACKS);
    NvtxFunctionTable table = NULL;
    unsigned int size = 0;
    const char *path = getenv("MINISPEED_NVTX_CAPTURE");
    if (!callbacks || !path) return 0; /* 0: refuse, NVTX calls stay no-ops */
    capture_file = fopen(path, "w");
    if (!capture_file) return 0;
    if (!callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &table, &size)) return 0;
    set_entry(table, size, NVTX_CBID_CORE_RangePushA, (NvtxFunctionPointer)push_a);
    set_entry(table, size, NVTX_CBID_CORE_RangePushEx, (NvtxFunctionPointer)push_ex);
    set_entry(table, size, NVTX_CBID_CORE_RangePop, (NvtxFunctionPointer)pop);
    if (!callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table, &size)) return 0;
    set_entry(table, size, NVTX_CBID_CORE2_DomainRangePushEx, (NvtxFunctionPointer)domain_push_ex);
    set_entry(table, size, NVTX_CBID_CORE2_DomainRangePop, (NvtxFunctionPointer)domain_pop);
    set_entry(table, size, NVTX_CBID_CORE2_DomainRegisterStringA, (NvtxFunctionPointer)register_string_a);
    set_entry(table, size, NVTX_CBID_CORE2_DomainCreateA, (NvtxFunctionPointer)domain_create_a);
    return 1;
}
