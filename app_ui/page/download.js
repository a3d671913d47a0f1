// An export the server formatted ({name, type, text}; it keeps nothing) saved as a file by the browser.
(file) => {
  if (!file?.text) return;
  const link = document.createElement('a');
  link.href = URL.createObjectURL(new Blob([file.text], { type: file.type }));
  link.download = file.name;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 10000);
}
